//! A TCP proxy in front of the test server whose plug can be pulled: the
//! database becomes unreachable for the pools that connect through it (live
//! connections break, new ones are refused) while everyone else still reaches it.

use std::net::SocketAddr;

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use crate::TestDb;

/// A running proxy; [`cut`](Proxy::cut) makes the database unreachable through it.
#[derive(Debug)]
pub struct Proxy {
    options: PgConnectOptions,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Starts a proxy to `db`'s server.
    ///
    /// # Panics
    ///
    /// When it cannot bind a port on 127.0.0.1.
    pub async fn start(db: &TestDb) -> Proxy {
        let target = format!("{}:{}", db.options.get_host(), db.options.get_port());
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let addr: SocketAddr = listener.local_addr().expect("proxy address");
        let task = tokio::spawn(async move {
            // Connections die with this task: aborting it drops the JoinSet.
            let mut connections = JoinSet::new();
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    continue;
                };
                let target = target.clone();
                connections.spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
                while connections.try_join_next().is_some() {}
            }
        });
        let options = db.options.clone().host("127.0.0.1").port(addr.port());
        Proxy { options, task }
    }

    /// A pool that reaches the database through this proxy.
    ///
    /// # Panics
    ///
    /// When it cannot connect.
    pub async fn pool(&self, max_connections: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(std::time::Duration::from_secs(2))
            .connect_with(self.options.clone())
            .await
            .expect("connect through the proxy")
    }

    /// Pulls the plug: every connection through the proxy breaks, and new
    /// ones are refused.
    pub async fn cut(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

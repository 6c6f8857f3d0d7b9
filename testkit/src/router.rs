//! A TCP router with a switchable upstream: what clients of a failover
//! cluster connect to.
//!
//! sqlx has no multi-host connection strings and no `target_session_attrs`
//! (libpq's `host=a,b target_session_attrs=read-write`), so a sqlx pool
//! cannot find the new primary by itself. Production setups put a router in
//! front of the cluster: HAProxy whose health check asks Patroni's REST API
//! which node is the primary, a virtual IP or a DNS name that moves, or a
//! PgBouncer repointed at the new primary. This router does what HAProxy
//! does when its health check flips (with `on-marked-down shutdown-sessions`):
//!
//! - [`Router::take_down`]: the upstream is marked down; every connection
//!   through the router is closed, and new ones are accepted and closed at
//!   once (no healthy server);
//! - [`Router::switch_to`]: connections to the previous upstream are closed,
//!   and new ones go to the new upstream.
//!
//! The switch is driven by the test (it knows when it promoted the
//! standby), not by a health check of the router's own.

use std::net::SocketAddr;

use sqlx::postgres::PgConnectOptions;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// Where new connections go; `generation` changes at every switch, and
/// connections of an older generation close.
#[derive(Debug, Clone)]
struct Route {
    upstream: Option<String>,
    generation: u64,
}

/// A running router; see the [module docs](self).
#[derive(Debug)]
pub struct Router {
    address: SocketAddr,
    route: watch::Sender<Route>,
    task: tokio::task::JoinHandle<()>,
}

impl Router {
    /// Starts a router on a free port of 127.0.0.1 that forwards to
    /// `upstream` (`host:port`).
    ///
    /// # Panics
    ///
    /// When it cannot bind a port on 127.0.0.1.
    pub async fn start(upstream: impl Into<String>) -> Router {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the router");
        let address = listener.local_addr().expect("router address");
        let (route, routes) = watch::channel(Route {
            upstream: Some(upstream.into()),
            generation: 0,
        });
        let task = tokio::spawn(async move {
            // Connections die with this task: aborting it drops the JoinSet.
            let mut connections = JoinSet::new();
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                connections.spawn(forward(client, routes.clone()));
                while connections.try_join_next().is_some() {}
            }
        });
        Router {
            address,
            route,
            task,
        }
    }

    /// The address clients connect to.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Connect options for the router's address (host and port only: add
    /// the user and the database).
    pub fn options(&self) -> PgConnectOptions {
        PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.address.port())
    }

    /// The upstream new connections go to, if any.
    pub fn upstream(&self) -> Option<String> {
        self.route.borrow().upstream.clone()
    }

    /// Sends new connections to `upstream` and closes every connection to
    /// the previous one.
    pub fn switch_to(&self, upstream: impl Into<String>) {
        let upstream = upstream.into();
        self.route.send_modify(|route| {
            route.upstream = Some(upstream);
            route.generation += 1;
        });
    }

    /// Marks the upstream down: every connection closes, and new ones are
    /// closed as soon as they are accepted, until [`switch_to`](Self::switch_to).
    pub fn take_down(&self) {
        self.route.send_modify(|route| {
            route.upstream = None;
            route.generation += 1;
        });
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One client connection: to the upstream of the moment, until either side
/// closes or the route changes.
async fn forward(mut client: TcpStream, mut routes: watch::Receiver<Route>) {
    let route = routes.borrow_and_update().clone();
    let Some(upstream) = route.upstream else {
        return; // No healthy server: the client's connection closes at once.
    };
    let Ok(mut server) = TcpStream::connect(&upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let switched = routes.wait_for(|now| now.generation != route.generation);
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
        // Both sockets close here (dropped), as HAProxy's shutdown-sessions does.
        _ = switched => {}
    }
}

//! A TCP proxy in front of the test server, for tests of what a client sees
//! when the network fails, while everyone else still reaches the database:
//!
//! - [`Proxy::cut`] pulls the plug: every connection through the proxy is
//!   closed (the client reads end-of-file or a reset at once) and new ones
//!   are refused;
//! - [`Proxy::reset`] closes every connection through the proxy at once,
//!   dropping whatever it held back, and keeps accepting new ones: what a
//!   client sees when its connection breaks while a reply is on its way;
//! - [`Proxy::blackhole`] partitions the link: nothing is forwarded in either
//!   direction, but no socket is closed, so neither end learns anything (no
//!   FIN, no RST), as when a cable or a firewall drops packets. Writes are
//!   accepted until the buffers fill, reads wait. A client connecting
//!   meanwhile gets its TCP handshake (the kernel completes it) and then no
//!   answer. [`Proxy::restore`] heals it: what was held back is delivered and
//!   connections go on, as TCP's retransmissions would deliver it after a
//!   partition ends. This is the half-open link that only timeouts, keepalives
//!   or heartbeats can detect.

use std::net::SocketAddr;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::TestDb;

/// A running proxy; see the [module docs](self).
#[derive(Debug)]
pub struct Proxy {
    options: PgConnectOptions,
    address: SocketAddr,
    /// `true` while the link is partitioned.
    blackholed: watch::Sender<bool>,
    /// Bumped by [`Proxy::reset`].
    resets: watch::Sender<u64>,
    /// The last reset the proxy has carried out.
    done: watch::Receiver<u64>,
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
        let mut proxy = Proxy::start_to(target).await;
        proxy.options = db
            .options
            .clone()
            .host("127.0.0.1")
            .port(proxy.address.port());
        proxy
    }

    /// Starts a proxy to any TCP address (`host:port`); [`pool`](Self::pool)
    /// then connects as the test server's default user.
    ///
    /// # Panics
    ///
    /// When it cannot bind a port on 127.0.0.1.
    pub async fn start_to(target: impl Into<String>) -> Proxy {
        let target = target.into();
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let address: SocketAddr = listener.local_addr().expect("proxy address");
        let (blackholed, state) = watch::channel(false);
        let (resets, mut reset) = watch::channel(0u64);
        let (done_tx, done) = watch::channel(0u64);
        let task = tokio::spawn(async move {
            // Connections die with this task: aborting it drops the JoinSet.
            let mut connections = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((client, _)) = accepted else {
                            continue;
                        };
                        connections.spawn(forward(client, target.clone(), state.clone()));
                    }
                    changed = reset.changed() => {
                        if changed.is_err() {
                            return;
                        }
                        // Dropping a connection's task drops both its sockets.
                        connections.abort_all();
                        while connections.join_next().await.is_some() {}
                        done_tx.send_replace(*reset.borrow_and_update());
                    }
                }
                while connections.try_join_next().is_some() {}
            }
        });
        Proxy {
            options: PgConnectOptions::new()
                .host("127.0.0.1")
                .port(address.port()),
            address,
            blackholed,
            resets,
            done,
            task,
        }
    }

    /// The address clients connect to.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// A pool that reaches the database through this proxy (acquire timeout 2 s).
    ///
    /// # Panics
    ///
    /// When it cannot connect.
    pub async fn pool(&self, max_connections: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(2))
            .connect_with(self.options.clone())
            .await
            .expect("connect through the proxy")
    }

    /// Connect options for the database through this proxy.
    pub fn options(&self) -> PgConnectOptions {
        self.options.clone()
    }

    /// Partitions the link: from now on nothing is forwarded either way, and
    /// no socket is closed. Undo with [`restore`](Self::restore).
    pub fn blackhole(&self) {
        self.blackholed.send_replace(true);
    }

    /// Heals a [`blackhole`](Self::blackhole): what was held back is
    /// delivered, and forwarding goes on.
    pub fn restore(&self) {
        self.blackholed.send_replace(false);
    }

    /// Breaks every connection through the proxy (both ends see their socket
    /// closed), dropping whatever a [`blackhole`](Self::blackhole) held
    /// back, and returns once they are all gone; new connections are accepted
    /// as before (still held while blackholed).
    pub async fn reset(&self) {
        let mut target = 0;
        self.resets.send_modify(|n| {
            *n += 1;
            target = *n;
        });
        let mut done = self.done.clone();
        let _ = done.wait_for(|n| *n >= target).await;
    }

    /// Whether the link is partitioned.
    pub fn is_blackholed(&self) -> bool {
        *self.blackholed.borrow()
    }

    /// Pulls the plug: every connection through the proxy breaks, and new
    /// ones are refused.
    pub async fn cut(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

/// One client connection: connects onward (once the link is up) and pumps
/// both directions until either side closes.
async fn forward(client: TcpStream, target: String, state: watch::Receiver<bool>) {
    if !wait_until_open(&mut state.clone()).await {
        return;
    }
    let Ok(server) = TcpStream::connect(&target).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    // When one direction ends, the other goes on until its own end closes,
    // as copy_bidirectional does; the connection ends with both.
    tokio::join!(
        pump(client_read, server_write, state.clone()),
        pump(server_read, client_write, state),
    );
}

/// Copies `from` to `to`, holding everything while the link is blackholed:
/// neither reading (so the sender's writes back up, as over a dead link) nor
/// writing what was read just before the partition began.
async fn pump(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    mut state: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if !wait_until_open(&mut state).await {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => {
                // An end (or a reset) that arrives during a partition is held too.
                if wait_until_open(&mut state).await {
                    let _ = to.shutdown().await;
                }
                return;
            }
            Ok(n) => n,
        };
        if !wait_until_open(&mut state).await {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Waits while the link is blackholed; `false` when the proxy is gone.
async fn wait_until_open(state: &mut watch::Receiver<bool>) -> bool {
    state.wait_for(|blackholed| !blackholed).await.is_ok()
}

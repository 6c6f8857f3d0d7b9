//! The proxy itself: a blackhole holds traffic both ways without closing
//! anything, `restore` delivers what was held, `cut` closes at once.

use std::time::Duration;

use pg_semaphore_testkit::proxy::Proxy;
use pg_semaphore_testkit::{TestResult, empty_db};
use sqlx::{Connection, PgConnection};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

/// Longer than a loopback round trip by orders of magnitude.
const SILENCE: Duration = Duration::from_millis(500);

/// An echo server on 127.0.0.1: its address.
async fn echo_server() -> std::io::Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?.to_string();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut read, mut write) = socket.split();
                let _ = tokio::io::copy(&mut read, &mut write).await;
            });
        }
    });
    Ok(address)
}

async fn echo(client: &mut TcpStream, message: &[u8]) -> std::io::Result<Vec<u8>> {
    client.write_all(message).await?;
    let mut got = vec![0; message.len()];
    client.read_exact(&mut got).await?;
    Ok(got)
}

#[tokio::test]
async fn a_blackhole_holds_both_ways_without_closing_and_restore_delivers() -> TestResult {
    let proxy = Proxy::start_to(echo_server().await?).await;
    let mut client = TcpStream::connect(proxy.address()).await?;
    assert_eq!(echo(&mut client, b"before").await?, b"before");

    proxy.blackhole();
    assert!(proxy.is_blackholed());
    // The write is accepted (it fits in the buffers), but nothing comes back:
    // no echo, and no end-of-file or reset either (a read would return them).
    client.write_all(b"during").await?;
    let mut buf = [0u8; 16];
    assert!(
        timeout(SILENCE, client.read(&mut buf)).await.is_err(),
        "a read returned during the blackhole: data, end-of-file or a reset got through"
    );
    // A connection made meanwhile gets no answer either.
    let mut late = TcpStream::connect(proxy.address()).await?;
    late.write_all(b"late").await?;
    assert!(timeout(SILENCE, late.read(&mut buf)).await.is_err());

    proxy.restore();
    assert!(!proxy.is_blackholed());
    // What was held is delivered, in order, on the same connections.
    let mut got = [0u8; 6];
    timeout(Duration::from_secs(5), client.read_exact(&mut got)).await??;
    assert_eq!(&got, b"during");
    let mut got = [0u8; 4];
    timeout(Duration::from_secs(5), late.read_exact(&mut got)).await??;
    assert_eq!(&got, b"late");
    assert_eq!(echo(&mut client, b"after").await?, b"after");

    // Pulling the plug, by contrast, closes the connection at once.
    proxy.cut().await;
    let read = timeout(Duration::from_secs(5), client.read(&mut buf))
        .await
        .expect("a cut connection must end at once, not hang");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    Ok(())
}

#[tokio::test]
async fn a_query_through_a_blackhole_hangs_and_completes_after_restore() -> TestResult {
    let db = empty_db().await;
    let proxy = Proxy::start(&db).await;
    let mut conn = PgConnection::connect_with(&proxy.options()).await?;
    let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut conn)
        .await?;

    proxy.blackhole();
    let query = tokio::spawn(async move {
        let answer: sqlx::Result<i32> = sqlx::query_scalar("SELECT 41 + 1")
            .fetch_one(&mut conn)
            .await;
        (answer, conn)
    });
    tokio::time::sleep(SILENCE).await;
    assert!(
        !query.is_finished(),
        "the query got an answer through a blackhole"
    );
    // The server still has the session: nothing told it the client is gone.
    let alive: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1)")
            .bind(backend)
            .fetch_one(&db.pool)
            .await?;
    assert!(alive, "the server side of the connection was closed");

    proxy.restore();
    let (answer, conn) = timeout(Duration::from_secs(5), query).await??;
    assert_eq!(answer?, 42);
    conn.close().await?;
    Ok(())
}

#[tokio::test]
async fn a_reset_breaks_connections_drops_what_was_held_and_keeps_accepting() -> TestResult {
    let proxy = Proxy::start_to(echo_server().await?).await;
    let mut client = TcpStream::connect(proxy.address()).await?;
    assert_eq!(echo(&mut client, b"before").await?, b"before");

    proxy.blackhole();
    client.write_all(b"held").await?;
    proxy.reset().await;
    proxy.restore();
    // The old connection ends, and what was held never arrives.
    let mut buf = [0u8; 16];
    let read = timeout(Duration::from_secs(5), client.read(&mut buf))
        .await
        .expect("a reset connection must end at once, not hang");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    // New connections go through.
    let mut fresh = TcpStream::connect(proxy.address()).await?;
    assert_eq!(echo(&mut fresh, b"after").await?, b"after");
    Ok(())
}

//! Headless Chromium driven over the DevTools protocol, with no dependency:
//! a page that keeps changing (the live dashboard) cannot be read with
//! `--dump-dom`, which dumps once at the load event. Chromium is started
//! with `--remote-debugging-port=0`; the test talks to its page's target
//! over a WebSocket written here (text frames, the client's masked with a
//! zero key), evaluates expressions in the page, collects its console
//! errors and uncaught exceptions, and captures screenshots.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

/// A headless Chromium and the WebSocket of its one page.
#[derive(Debug)]
pub struct Browser {
    child: Child,
    profile: PathBuf,
    socket: TcpStream,
    next_id: u64,
    /// Console errors and uncaught exceptions, as text.
    pub errors: Vec<String>,
}

impl Browser {
    /// Starts `chromium` headless at `about:blank`, `width` x `height`.
    pub async fn start(chromium: &Path, width: u32, height: u32) -> Browser {
        static PROFILES: AtomicU32 = AtomicU32::new(0);
        let profile = std::env::temp_dir().join(format!(
            "pgsem-cdp-{}-{}",
            std::process::id(),
            PROFILES.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&profile);
        let mut child = Command::new(chromium)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
                "--remote-debugging-port=0",
                "--remote-allow-origins=*",
            ])
            .arg(format!("--window-size={width},{height}"))
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("about:blank")
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start chromium");
        // "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/ID"
        let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
        let port = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = lines.next_line().await.expect("chromium's stderr") {
                if let Some(rest) = line.split("ws://127.0.0.1:").nth(1) {
                    return rest
                        .split('/')
                        .next()
                        .expect("port")
                        .parse::<u16>()
                        .expect("port");
                }
            }
            panic!("chromium ended without a DevTools port");
        })
        .await
        .expect("chromium opens its DevTools port within 30 s");
        // Keep draining its stderr so that it never blocks on it.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let targets: Value =
            serde_json::from_str(&http_get(port, "/json/list").await).expect("targets");
        let page = targets
            .as_array()
            .and_then(|t| t.iter().find(|t| t["type"] == "page"))
            .expect("a page target");
        let ws = page["webSocketDebuggerUrl"]
            .as_str()
            .expect("its WebSocket");
        let path = ws.split_once(&format!(":{port}")).expect("ws URL").1;
        let mut socket = TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect");
        socket
            .write_all(
                format!(
                    "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n\
                     Connection: Upgrade\r\nSec-WebSocket-Key: cGctc2VtYXBob3JlLXRlc3Q=\r\n\
                     Sec-WebSocket-Version: 13\r\n\r\n"
                )
                .as_bytes(),
            )
            .await
            .expect("handshake");
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            head.push(socket.read_u8().await.expect("handshake answer"));
        }
        assert!(
            head.starts_with(b"HTTP/1.1 101"),
            "{}",
            String::from_utf8_lossy(&head)
        );
        let mut browser = Browser {
            child,
            profile,
            socket,
            next_id: 0,
            errors: Vec::new(),
        };
        for domain in ["Page.enable", "Runtime.enable", "Log.enable"] {
            browser.call(domain, json!({})).await;
        }
        browser
    }

    /// Calls `method`; its result. Events that arrive meanwhile are looked
    /// at for errors.
    pub async fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let message = json!({"id": id, "method": method, "params": params}).to_string();
        send(&mut self.socket, message.as_bytes()).await;
        loop {
            let text = tokio::time::timeout(Duration::from_secs(30), receive(&mut self.socket))
                .await
                .unwrap_or_else(|_| panic!("chromium did not answer {method} within 30 s"));
            let message: Value = serde_json::from_str(&text).expect("a JSON message");
            if message["id"] == id {
                assert!(message["error"].is_null(), "{method}: {}", message["error"]);
                return message["result"].clone();
            }
            self.note(&message);
        }
    }

    fn note(&mut self, event: &Value) {
        let params = &event["params"];
        match event["method"].as_str() {
            Some("Runtime.exceptionThrown") => self
                .errors
                .push(format!("uncaught: {}", params["exceptionDetails"])),
            Some("Runtime.consoleAPICalled") if params["type"] == "error" => self
                .errors
                .push(format!("console.error: {}", params["args"])),
            Some("Log.entryAdded") if params["entry"]["level"] == "error" => {
                self.errors.push(format!("log: {}", params["entry"]))
            }
            _ => {}
        }
    }

    /// Opens `url`.
    pub async fn navigate(&mut self, url: &str) {
        let result = self.call("Page.navigate", json!({"url": url})).await;
        assert!(
            result["errorText"].is_null(),
            "navigate {url}: {}",
            result["errorText"]
        );
    }

    /// The value of `expression` in the page.
    pub async fn eval(&mut self, expression: &str) -> Value {
        let result = self
            .call(
                "Runtime.evaluate",
                json!({"expression": expression, "returnByValue": true}),
            )
            .await;
        assert!(
            result["exceptionDetails"].is_null(),
            "{expression}: {}",
            result["exceptionDetails"]
        );
        result["result"]["value"].clone()
    }

    /// Polls `expression` every 50 ms until it is `true`, for at most `within`.
    pub async fn until(&mut self, within: Duration, expression: &str) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if self.eval(expression).await == Value::Bool(true) {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A PNG of the page's whole height, written to `file`.
    pub async fn screenshot(&mut self, file: &Path) {
        let result = self
            .call(
                "Page.captureScreenshot",
                json!({"format": "png", "captureBeyondViewport": true}),
            )
            .await;
        let png = base64(result["data"].as_str().expect("data"));
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "a PNG");
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir).expect("the screenshot's directory");
        }
        std::fs::write(file, png).expect("write the screenshot");
    }

    /// Ends Chromium.
    pub async fn close(mut self) {
        let _ = self.child.kill().await;
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// `GET path` of Chromium's DevTools HTTP server, which keeps the
/// connection open: the body is read by its `Content-Length`.
async fn http_get(port: u16, path: &str) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n").as_bytes())
        .await
        .expect("request");
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        head.push(stream.read_u8().await.expect("response"));
    }
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .expect("a Content-Length")
        .trim()
        .parse()
        .expect("a length");
    let mut body = vec![0; length];
    stream.read_exact(&mut body).await.expect("body");
    String::from_utf8(body).expect("UTF-8")
}

/// One masked text frame (the mask key is zero: the payload goes as is).
async fn send(socket: &mut TcpStream, payload: &[u8]) {
    let mut frame = vec![0x81];
    match payload.len() {
        n if n < 126 => frame.push(0x80 | n as u8),
        n if n <= 0xffff => {
            frame.push(0x80 | 126);
            frame.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            frame.push(0x80 | 127);
            frame.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    frame.extend_from_slice(&[0; 4]);
    frame.extend_from_slice(payload);
    socket.write_all(&frame).await.expect("send a frame");
}

/// One message (its frames joined), as text.
async fn receive(socket: &mut TcpStream) -> String {
    let mut message = Vec::new();
    loop {
        let head = socket.read_u8().await.expect("a frame");
        let len = socket.read_u8().await.expect("a frame") & 0x7f;
        let len = match len {
            126 => socket.read_u16().await.expect("length") as usize,
            127 => socket.read_u64().await.expect("length") as usize,
            n => n as usize,
        };
        let start = message.len();
        message.resize(start + len, 0);
        socket
            .read_exact(&mut message[start..])
            .await
            .expect("payload");
        if head & 0x80 != 0 {
            return String::from_utf8(message).expect("a text message");
        }
    }
}

fn base64(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    };
    let bytes: Vec<u8> = text.bytes().filter(|&c| c != b'=').collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= u32::from(value(c)) << (18 - 6 * i);
        }
        out.extend_from_slice(&n.to_be_bytes()[1..chunk.len()]);
    }
    out
}

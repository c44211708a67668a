//! The ingest load generator's HTTP/1.1 client: one keep-alive connection
//! that writes a POST and reads the status and a `Content-Length` body.
//!
//! The load generator shares the machine's two cores with approvald, so
//! whatever it spends per request is taken from the figure it measures.
//! reqwest's pooled client cost about as much CPU per callback as
//! approvald's whole receive path; this costs a write and a read.

use std::io;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

pub struct RawClient {
    stream: BufReader<TcpStream>,
    host: String,
    request: Vec<u8>,
    line: Vec<u8>,
    body: Vec<u8>,
}

impl RawClient {
    /// Connects to `base` (`http://host:port`).
    pub async fn connect(base: &str) -> io::Result<Self> {
        let host = base.strip_prefix("http://").unwrap_or(base).trim_end_matches('/').to_string();
        let stream = TcpStream::connect(&host).await?;
        stream.set_nodelay(true)?;
        Ok(Self {
            stream: BufReader::new(stream),
            host,
            request: Vec::with_capacity(1024),
            line: Vec::with_capacity(256),
            body: Vec::with_capacity(256),
        })
    }

    /// POSTs `body` to `path` with one extra header; returns the status code
    /// once the whole response has been read, so the connection can be reused.
    pub async fn post(&mut self, path: &str, header: (&str, &str), body: &[u8]) -> io::Result<u16> {
        self.request.clear();
        self.request.extend_from_slice(
            format!(
                "POST {path} HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\n{}: {}\r\n\
                 content-length: {}\r\n\r\n",
                self.host,
                header.0,
                header.1,
                body.len()
            )
            .as_bytes(),
        );
        self.request.extend_from_slice(body);
        self.stream.get_mut().write_all(&self.request).await?;

        let status = {
            self.read_line().await?;
            let line = std::str::from_utf8(&self.line).map_err(|_| bad("status line is not UTF-8"))?;
            line.split_whitespace()
                .nth(1)
                .and_then(|s| s.parse::<u16>().ok())
                .ok_or_else(|| bad("no status code"))?
        };
        let mut length = None;
        loop {
            self.read_line().await?;
            let line = std::str::from_utf8(&self.line).map_err(|_| bad("header is not UTF-8"))?.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((name, value)) = line.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = Some(value.trim().parse::<usize>().map_err(|_| bad("bad content-length"))?);
                } else if name.eq_ignore_ascii_case("transfer-encoding") {
                    return Err(bad("chunked responses are not read by this client"));
                }
            }
        }
        let length = length.ok_or_else(|| bad("response without content-length"))?;
        self.body.resize(length, 0);
        self.stream.read_exact(&mut self.body).await?;
        Ok(status)
    }

    async fn read_line(&mut self) -> io::Result<()> {
        self.line.clear();
        if self.stream.read_until(b'\n', &mut self.line).await? == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed"));
        }
        Ok(())
    }
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::Router;
    use axum::routing::post;

    /// A real server on a loopback port: it echoes the signature header's
    /// length and answers 401 when the header is missing.
    async fn server() -> String {
        async fn echo(
            headers: axum::http::HeaderMap,
            body: axum::body::Bytes,
        ) -> (axum::http::StatusCode, String) {
            match headers.get("x-sig") {
                Some(v) => (axum::http::StatusCode::ACCEPTED, format!("{}:{}", v.len(), body.len())),
                None => (axum::http::StatusCode::UNAUTHORIZED, String::new()),
            }
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let app = Router::new().route("/in", post(echo));
        tokio::spawn(async move { axum::serve(listener, app).await });
        base
    }

    #[tokio::test]
    async fn posts_and_reads_whole_responses_on_one_kept_alive_connection() {
        let base = server().await;
        let mut c = RawClient::connect(&base).await.expect("connect");
        for n in 0..3 {
            let body = vec![b'x'; 300 + n];
            assert_eq!(c.post("/in", ("x-sig", "abcd"), &body).await.expect("post"), 202);
            assert_eq!(c.body, format!("4:{}", 300 + n).into_bytes());
        }
        // An empty response body is read too, and the connection stays usable.
        assert_eq!(c.post("/in", ("x-other", "1"), b"{}").await.expect("post"), 401);
        assert!(c.body.is_empty());
        assert_eq!(c.post("/in", ("x-sig", "ab"), b"{}").await.expect("post"), 202);
        assert_eq!(c.body, b"2:2");
    }

    #[tokio::test]
    async fn a_closed_connection_is_an_error_not_a_status() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        // Accepts, reads the whole request, and hangs up without answering
        // (reading it all makes the hang-up a clean close, not a reset).
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("accept");
            let mut got = Vec::new();
            let mut buf = [0u8; 256];
            while !got.ends_with(b"\r\n\r\n{}") {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
        });
        let mut c = RawClient::connect(&base).await.expect("connect");
        let e = c.post("/in", ("x-sig", "a"), b"{}").await.expect_err("no response");
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }
}

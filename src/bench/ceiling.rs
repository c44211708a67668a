//! The ingest ceiling: what any receiver on this machine's HTTP stack could
//! acknowledge. A receiver that does nothing (no signature, no parse, no
//! commit: it reads the body and answers 200 with approvald's answer) on
//! axum and hyper, with a tokio runtime of its own as the daemon has, driven
//! by the same clients as the ingest run. approvald's ingest does all of
//! that work and more on the same two cores, so it cannot exceed this rate;
//! a target above the ceiling is out of reach on the machine, whatever
//! approvald does (docs/performance.md).

use axum::Router;
use axum::routing::post;
use tokio_util::sync::CancellationToken;

/// A running no-op receiver; stops when dropped.
pub struct Ceiling {
    pub base: String,
    stop: CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Ceiling {
    /// Starts the receiver on a loopback port, on a runtime and threads of
    /// its own, apart from the load generator's.
    pub fn start() -> anyhow::Result<Self> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let base = format!("http://{}", listener.local_addr()?);
        let stop = CancellationToken::new();
        let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
        let token = stop.clone();
        let thread = std::thread::Builder::new().name("bench-ceiling".into()).spawn(move || {
            runtime.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else { return };
                let app = Router::new().route(
                    "/v1/callbacks/pushary",
                    post(|_body: axum::body::Bytes| async {
                        axum::Json(serde_json::json!({"status": "stored"}))
                    }),
                );
                let _ = axum::serve(listener, app).with_graceful_shutdown(token.cancelled_owned()).await;
            });
        })?;
        Ok(Self { base, stop, thread: Some(thread) })
    }
}

impl Drop for Ceiling {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The ceiling answers a callback as approvald does, over a kept-alive
    // connection, so the ingest load generator counts it acknowledged.
    #[tokio::test]
    async fn the_ceiling_acknowledges_posts_on_one_connection() {
        let ceiling = Ceiling::start().expect("starts");
        let mut client = super::super::raw_http::RawClient::connect(&ceiling.base).await.expect("connects");
        for _ in 0..3 {
            let status = client.post("/v1/callbacks/pushary", ("x-pushary-signature", "x"), b"{}").await;
            assert_eq!(status.expect("answers"), 200);
        }
        let other = client.post("/elsewhere", ("x-pushary-signature", "x"), b"{}").await.expect("answers");
        assert_eq!(other, 404, "only the callback route is served");
    }
}

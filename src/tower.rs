//! A tower layer that limits an HTTP service's concurrent requests with a
//! [`Semaphore`]: a limit shared by every process, every machine.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use ::tower::{Layer, Service};
use http::header::{HeaderValue, RETRY_AFTER};
use http::{Request, Response, StatusCode};

use crate::error::Error;
use crate::fail_open::{self, Unchecked};
use crate::semaphore::{Permit, Semaphore};

/// Limits the requests in flight in the wrapped service to the capacity of a
/// [`Semaphore`], across every process that uses the same semaphore.
///
/// Each request claims a slot before it reaches the service and holds it
/// until the service's response future completes; then the permit is
/// released (awaited, so the slot is free by the time the response is
/// returned). If the response future is dropped first (the client went
/// away, a timeout layer fired), the permit's `Drop` releases the slot in the
/// background. A streamed response body is not covered: the slot is freed
/// once the headers are ready.
///
/// Two modes:
///
/// - **fail fast** (the default): when every slot is held, answer at once
///   with `503 Service Unavailable`, or the status set by
///   [`reject_with`](Self::reject_with) (typically `429 Too Many Requests`),
///   with an empty body and an optional `Retry-After` header;
/// - **wait** ([`wait`](Self::wait)): wait up to a timeout for a slot
///   (woken by `NOTIFY`, not polling), then reject as above.
///
/// When the database cannot be reached (or the semaphore is gone), requests
/// are answered `503 Service Unavailable` and the error is logged, unless
/// [`fail_open`](Self::fail_open) lets them through unlimited.
///
/// # Example
///
/// ```no_run
/// use std::time::Duration;
/// use axum::{Router, routing::post};
/// use http::StatusCode;
/// use pg_semaphore::{Semaphore, tower::SemaphoreLayer};
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// # let client = pg_semaphore::Client::new(pool.clone());
/// let upstream = Semaphore::builder("payments-api", 4).build(&client).await?;
/// let app: Router = Router::new()
///     .route("/charge", post(|| async { "charged" }))
///     .layer(
///         SemaphoreLayer::new(upstream)
///             .wait(Duration::from_secs(2)) // then 429
///             .reject_with(StatusCode::TOO_MANY_REQUESTS)
///             .retry_after(Duration::from_secs(1)),
///     );
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }
/// ```
#[derive(Clone)]
#[must_use = "a layer does nothing until it wraps a service"]
pub struct SemaphoreLayer {
    semaphore: Semaphore,
    config: Arc<Config>,
}

#[derive(Debug, Clone)]
struct Config {
    wait: Option<Duration>,
    status: StatusCode,
    retry_after: Option<HeaderValue>,
    fail_open: bool,
    record_requests: bool,
}

impl fmt::Debug for SemaphoreLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SemaphoreLayer")
            .field("semaphore", &self.semaphore.name())
            .field("wait", &self.config.wait)
            .field("reject_with", &self.config.status)
            .field("retry_after", &self.config.retry_after)
            .field("fail_open", &self.config.fail_open)
            .field("record_requests", &self.config.record_requests)
            .finish()
    }
}

impl SemaphoreLayer {
    /// A fail-fast layer on `semaphore`: a request that finds every slot
    /// held is answered `503 Service Unavailable` at once.
    pub fn new(semaphore: Semaphore) -> Self {
        SemaphoreLayer {
            semaphore,
            config: Arc::new(Config {
                wait: None,
                status: StatusCode::SERVICE_UNAVAILABLE,
                retry_after: None,
                fail_open: false,
                record_requests: false,
            }),
        }
    }

    fn config(mut self, change: impl FnOnce(&mut Config)) -> Self {
        change(Arc::make_mut(&mut self.config));
        self
    }

    /// Waits up to `timeout` for a slot before rejecting the request.
    pub fn wait(self, timeout: Duration) -> Self {
        self.config(|c| c.wait = Some(timeout))
    }

    /// Rejects at once when every slot is held (the default).
    pub fn fail_fast(self) -> Self {
        self.config(|c| c.wait = None)
    }

    /// The status of a rejected request (default `503 Service Unavailable`;
    /// `429 Too Many Requests` is the other common choice). The body is empty.
    pub fn reject_with(self, status: StatusCode) -> Self {
        self.config(|c| c.status = status)
    }

    /// Adds `Retry-After: <seconds>` (rounded up) to rejected responses.
    pub fn retry_after(self, after: Duration) -> Self {
        let seconds = after.as_secs() + u64::from(after.subsec_nanos() > 0);
        self.config(|c| c.retry_after = Some(HeaderValue::from(seconds)))
    }

    /// When the database cannot be reached, serve requests without a limit
    /// instead of answering 503 (default `false`), as
    /// [`SemaphoreBuilder::fail_open`](crate::SemaphoreBuilder::fail_open)
    /// decides it: a pool that is merely busy, missing migrations or any
    /// other answer from the database still get 503. The error is logged
    /// either way.
    pub fn fail_open(self, enabled: bool) -> Self {
        self.config(|c| c.fail_open = enabled)
    }

    /// Records each request's method and path in its claim's metadata
    /// (`{"method": "POST", "path": "/charge"}`), for the audit log (default
    /// `false`).
    pub fn record_requests(self, enabled: bool) -> Self {
        self.config(|c| c.record_requests = enabled)
    }
}

impl<S> Layer<S> for SemaphoreLayer {
    type Service = SemaphoreService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        SemaphoreService {
            inner,
            semaphore: self.semaphore.clone(),
            config: self.config.clone(),
        }
    }
}

/// The service made by [`SemaphoreLayer`]; see there.
#[derive(Clone)]
pub struct SemaphoreService<S> {
    inner: S,
    semaphore: Semaphore,
    config: Arc<Config>,
}

impl<S> fmt::Debug for SemaphoreService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SemaphoreService")
            .field("semaphore", &self.semaphore.name())
            .field("wait", &self.config.wait)
            .field("reject_with", &self.config.status)
            .finish_non_exhaustive()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for SemaphoreService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Default + Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<Response<ResBody>, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // Call the instance that poll_ready made ready; keep a fresh clone.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let semaphore = self.semaphore.clone();
        let config = self.config.clone();
        let metadata = config.record_requests.then(|| {
            serde_json::json!({
                "method": request.method().as_str(),
                "path": request.uri().path(),
            })
        });
        ResponseFuture {
            future: Box::pin(async move {
                let permit = match acquire(&semaphore, config.wait, metadata).await {
                    Ok(permit) => Some(permit),
                    Err(error) if error.is_busy() => {
                        return Ok(reject(config.status, config.retry_after.as_ref()));
                    }
                    Err(error)
                        if fail_open::admits(
                            config.fail_open,
                            &error,
                            semaphore.pool(),
                            Unchecked::Request {
                                semaphore: semaphore.name(),
                                metrics: semaphore.metrics(),
                            },
                        )
                        .await =>
                    {
                        None
                    }
                    Err(error) => {
                        tracing::error!(semaphore = semaphore.name(), %error,
                            "cannot use the semaphore: rejecting the request");
                        return Ok(reject(StatusCode::SERVICE_UNAVAILABLE, None));
                    }
                };
                // If this future is dropped while the service runs, the
                // permit's Drop releases the slot in the background.
                let response = inner.call(request).await;
                if let Some(permit) = permit
                    && let Err(error) = permit.release().await
                {
                    // Typically PermitLost: the request outlived the lease.
                    tracing::warn!(semaphore = semaphore.name(), %error,
                        "releasing a request's permit failed");
                }
                response
            }),
        }
    }
}

async fn acquire(
    semaphore: &Semaphore,
    wait: Option<Duration>,
    metadata: Option<serde_json::Value>,
) -> Result<Permit, Error> {
    let mut claim = semaphore.acquiring();
    if let Some(metadata) = metadata {
        claim = claim.metadata(metadata);
    }
    match wait {
        None => claim.try_acquire().await,
        // An outage is answered at once (503, or fail-open), not waited out.
        Some(timeout) => claim.fail_on_outage().timeout(timeout).acquire().await,
    }
}

fn reject<B: Default>(status: StatusCode, retry_after: Option<&HeaderValue>) -> Response<B> {
    let mut response = Response::new(B::default());
    *response.status_mut() = status;
    if let Some(value) = retry_after {
        response.headers_mut().insert(RETRY_AFTER, value.clone());
    }
    response
}

/// The response future of [`SemaphoreService`]: claims a slot, runs the
/// inner service's future, releases the slot.
#[must_use = "futures do nothing unless polled"]
pub struct ResponseFuture<T, E> {
    future: Pin<Box<dyn Future<Output = Result<T, E>> + Send>>,
}

impl<T, E> fmt::Debug for ResponseFuture<T, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<T, E> Future for ResponseFuture<T, E> {
    type Output = Result<T, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.future.as_mut().poll(cx)
    }
}

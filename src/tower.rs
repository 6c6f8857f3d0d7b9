//! Tower layers for HTTP services, with limits shared by every process on
//! every machine:
//!
//! - [`SemaphoreLayer`]: the requests in flight, under a [`Semaphore`], a
//!   [`SemaphoreFamily`] key taken from the request (a tenant), or both in
//!   one all-or-nothing claim, with rate limits in the same claim if asked
//!   ([`SemaphoreLayer::rate_limit`]);
//! - [`RateLimitLayer`]: the requests started per unit of time, under a
//!   [`RateLimiter`] keyed by the request, answering `429` with
//!   `Retry-After` (or waiting up to a bound).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use ::tower::{Layer, Service};
use http::header::{HeaderValue, RETRY_AFTER};
use http::request::Parts;
use http::{Request, Response, StatusCode};

use crate::error::{Error, WaitedFor};
use crate::fail_open::{self, Unchecked};
use crate::metrics::SemaphoreMetrics;
use crate::rate_limit::{ClaimRates, LimiterSet, RateLimiter};
use crate::semaphore::{Permit, Semaphore, SemaphoreFamily, acquire_with_rates};

/// Reads a limit's key (a tenant, a customer) from a request's head;
/// `None` leaves the request out of that limit.
type KeyFn = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;

/// Limits the requests in flight in the wrapped service to the capacity of a
/// [`Semaphore`], of a [`SemaphoreFamily`] key read from each request, or of
/// both at once, across every process that uses the same semaphores.
///
/// - [`SemaphoreLayer::new`]: one semaphore for every request.
/// - [`SemaphoreLayer::family`]: each request takes a slot of its key's
///   semaphore (say, its tenant's), the key read by a closure from the
///   request's head; a request for which the closure returns `None` is not
///   limited.
/// - [`SemaphoreLayer::new`] then [`per_key`](Self::per_key): both, in **one
///   all-or-nothing claim** ([`Semaphore::acquire_all`]): a request refused
///   by its tenant's limit never holds a global slot, and a waiting request
///   holds neither. Both must be built on the same
///   [`Client`](crate::Client).
///
/// Each request claims its slots before it reaches the service and holds them
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
///
/// Per tenant and overall, in one claim:
///
/// ```no_run
/// use pg_semaphore::{Client, Semaphore, SemaphoreFamily, tower::SemaphoreLayer};
///
/// # async fn run(client: Client) -> Result<(), Box<dyn std::error::Error>> {
/// let upstream = Semaphore::builder("payments-api", 20).build(&client).await?;
/// let tenants = SemaphoreFamily::builder("tenants", 4).build(&client).await?;
/// let layer = SemaphoreLayer::new(upstream).per_key(tenants, |request| {
///     let tenant = request.headers.get("x-tenant")?;
///     Some(tenant.to_str().ok()?.to_owned())
/// });
/// let app: axum::Router = axum::Router::new()
///     .route("/charge", axum::routing::post(|| async { "charged" }))
///     .layer(layer);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
#[must_use = "a layer does nothing until it wraps a service"]
pub struct SemaphoreLayer {
    limits: Arc<Limits>,
    config: Arc<Config>,
}

/// What a request of a [`SemaphoreLayer`] must hold.
#[derive(Clone)]
struct Limits {
    global: Option<Semaphore>,
    family: Option<(SemaphoreFamily, KeyFn)>,
    /// Rate limits charged in the same claim, each on the key its closure
    /// reads.
    rates: Vec<(RateLimiter, KeyFn)>,
}

impl Limits {
    /// A request under the rate limits only (its family key was `None` and
    /// there is no global semaphore): one check of them all, or a booking
    /// within `wait`.
    async fn rates_only(
        &self,
        rate_keys: &[Option<String>],
        wait: Option<Duration>,
    ) -> Result<(), Error> {
        let mut set = LimiterSet::new();
        for ((limiter, _), rate_key) in self.rates.iter().zip(rate_keys) {
            if let Some(rate_key) = rate_key {
                set = set.with_key(limiter, rate_key.clone());
            }
        }
        // Every limit has its own key: the set's key is never used.
        const UNUSED: &str = "-";
        if let Some(timeout) = wait {
            match set.acquire_timeout(UNUSED, 1, timeout).await {
                Ok(decision) if decision.allowed => return Ok(()),
                Ok(_) | Err(Error::Timeout { .. }) => {}
                Err(error) => return Err(error),
            }
        }
        let decision = set.check(UNUSED, 1).await?;
        if decision.allowed {
            return Ok(());
        }
        // (A set's decision does not say which limiter refused: name them.)
        let names: Vec<&str> = self
            .rates
            .iter()
            .zip(rate_keys)
            .filter(|(_, rate_key)| rate_key.is_some())
            .map(|((limiter, _), _)| limiter.name())
            .collect();
        Err(Error::RateLimited {
            limiter: names.join(", "),
            retry_after: decision.retry_after,
        })
    }

    /// The name a request's limit goes by in logs: the semaphore's, else
    /// `@family`.
    fn name(&self) -> String {
        match (&self.global, &self.family) {
            (Some(global), _) => global.name().to_owned(),
            (None, Some((family, _))) => format!("@{}", family.name()),
            (None, None) => String::new(),
        }
    }

    /// Holds what a request with `key` needs: a permit of the semaphore, of
    /// the key's semaphore, or one permit of both; nothing when the request
    /// is under no limit.
    async fn hold(
        &self,
        key: Option<&str>,
        rate_keys: Vec<Option<String>>,
        wait: Option<Duration>,
        metadata: Option<serde_json::Value>,
    ) -> Result<Option<Permit>, Error> {
        let family = self.family.as_ref().map(|(family, _)| family);
        let mut rates = ClaimRates::default();
        for ((limiter, _), rate_key) in self.rates.iter().zip(&rate_keys) {
            if let Some(rate_key) = rate_key {
                rates.push(limiter, rate_key.clone());
            }
        }
        if !rates.is_empty() {
            return match (&self.global, family.zip(key)) {
                (None, None) => self.rates_only(&rate_keys, wait).await.map(|()| None),
                (Some(global), None) => acquire_with_rates(&[global], rates, wait).await.map(Some),
                (global, Some((family, key))) => family
                    .with_key(key, |sem| {
                        let rates = rates.clone();
                        async move {
                            let semaphores: Vec<&Semaphore> =
                                global.iter().chain(std::iter::once(&sem)).collect();
                            acquire_with_rates(&semaphores, rates, wait).await
                        }
                    })
                    .await
                    .map(Some),
            };
        }
        match (&self.global, family.zip(key)) {
            (None, None) => Ok(None),
            (Some(global), None) => acquire(global, wait, metadata).await.map(Some),
            (None, Some((family, key))) => family
                .with_key(key, |sem| {
                    let metadata = metadata.clone();
                    async move { acquire(&sem, wait, metadata).await }
                })
                .await
                .map(Some),
            (Some(global), Some((family, key))) => family
                .with_key(
                    key,
                    |sem| async move { acquire_both(global, &sem, wait).await },
                )
                .await
                .map(Some),
        }
    }
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
            .field(
                "semaphore",
                &self.limits.global.as_ref().map(Semaphore::name),
            )
            .field(
                "family",
                &self.limits.family.as_ref().map(|(family, _)| family.name()),
            )
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
        SemaphoreLayer::with(Limits {
            global: Some(semaphore),
            family: None,
            rates: Vec::new(),
        })
    }

    /// A fail-fast layer on the keys of `family`: each request takes a slot
    /// of the semaphore of the key `key` reads from its head (its method,
    /// URI, headers, extensions); a request for which `key` returns `None`
    /// is not limited.
    pub fn family(
        family: SemaphoreFamily,
        key: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        SemaphoreLayer::with(Limits {
            global: None,
            family: Some((family, Arc::new(key))),
            rates: Vec::new(),
        })
    }

    /// Also limits each request by its key of `family` (as
    /// [`SemaphoreLayer::family`]), in one all-or-nothing claim with the
    /// semaphore: a request is admitted only when both have a free slot,
    /// and takes nothing from either otherwise. A request for which `key`
    /// returns `None` takes only the semaphore's slot.
    pub fn per_key(
        self,
        family: SemaphoreFamily,
        key: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.limits(|limits| limits.family = Some((family, Arc::new(key))))
    }

    /// Also charges each request one permit of `limiter`, on the key `key`
    /// reads from the request's head, **in the same claim** as its slots: a
    /// request is admitted only when its semaphores have room and the rate
    /// limit admits it, and takes nothing from any of them otherwise
    /// ([`Acquiring::rate_limit`](crate::Acquiring::rate_limit)). A request
    /// refused by the rate limit is answered `429 Too Many Requests` with
    /// `Retry-After` (the limit's, rounded up), whatever
    /// [`reject_with`](Self::reject_with) says; in [`wait`](Self::wait)
    /// mode it first waits for the limit to admit it, unless the limit
    /// would admit it only after the bound (then `429` at once). A
    /// request for which `key` returns `None` is not rate limited. Call it
    /// again for more limits. The limiters must be built on the semaphores'
    /// [`Client`](crate::Client).
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use pg_semaphore::{Client, RateLimiter, RatePolicy, Semaphore, SemaphoreFamily};
    /// use pg_semaphore::tower::SemaphoreLayer;
    ///
    /// # async fn run(client: Client) -> Result<(), Box<dyn std::error::Error>> {
    /// let upstream = Semaphore::builder("payments-api", 20).build(&client).await?;
    /// let tenants = SemaphoreFamily::builder("tenants", 4).build(&client).await?;
    /// let per_customer =
    ///     RateLimiter::builder("per-customer", RatePolicy::token_bucket(5.0, 5)).build(&client)?;
    /// let header = |name: &'static str| {
    ///     move |request: &http::request::Parts| {
    ///         Some(request.headers.get(name)?.to_str().ok()?.to_owned())
    ///     }
    /// };
    /// // 20 in flight, 4 per tenant, 5 per second per customer: one claim.
    /// let layer = SemaphoreLayer::new(upstream)
    ///     .per_key(tenants, header("x-tenant"))
    ///     .rate_limit(per_customer, header("x-customer"))
    ///     .wait(Duration::from_secs(1));
    /// let app: axum::Router = axum::Router::new()
    ///     .route("/charge", axum::routing::post(|| async { "charged" }))
    ///     .layer(layer);
    /// # Ok(())
    /// # }
    /// ```
    pub fn rate_limit(
        self,
        limiter: RateLimiter,
        key: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.limits(|limits| limits.rates.push((limiter, Arc::new(key))))
    }

    fn with(limits: Limits) -> Self {
        SemaphoreLayer {
            limits: Arc::new(limits),
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

    fn limits(mut self, change: impl FnOnce(&mut Limits)) -> Self {
        change(Arc::make_mut(&mut self.limits));
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
    /// `false`). Not for a claim of a semaphore and a key together, which
    /// carries no metadata.
    pub fn record_requests(self, enabled: bool) -> Self {
        self.config(|c| c.record_requests = enabled)
    }
}

impl<S> Layer<S> for SemaphoreLayer {
    type Service = SemaphoreService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        SemaphoreService {
            inner,
            limits: self.limits.clone(),
            config: self.config.clone(),
        }
    }
}

/// The service made by [`SemaphoreLayer`]; see there.
#[derive(Clone)]
pub struct SemaphoreService<S> {
    inner: S,
    limits: Arc<Limits>,
    config: Arc<Config>,
}

impl<S> fmt::Debug for SemaphoreService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SemaphoreService")
            .field("limit", &self.limits.name())
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
        let mut inner = take_ready(&mut self.inner);
        let limits = self.limits.clone();
        let config = self.config.clone();
        let (parts, body) = request.into_parts();
        let key = limits.family.as_ref().and_then(|(_, key)| key(&parts));
        let rate_keys: Vec<Option<String>> =
            limits.rates.iter().map(|(_, key)| key(&parts)).collect();
        let metadata = config.record_requests.then(|| {
            serde_json::json!({
                "method": parts.method.as_str(),
                "path": parts.uri.path(),
            })
        });
        let request = Request::from_parts(parts, body);
        ResponseFuture {
            future: Box::pin(async move {
                let permit = match limits
                    .hold(key.as_deref(), rate_keys, config.wait, metadata)
                    .await
                {
                    Ok(permit) => permit,
                    Err(Error::RateLimited { retry_after, .. }) => {
                        let seconds = retry_after.as_secs_f64().ceil().max(1.0) as u64;
                        let retry_after = HeaderValue::from(seconds);
                        return Ok(reject(StatusCode::TOO_MANY_REQUESTS, Some(&retry_after)));
                    }
                    Err(error) if error.is_busy() => {
                        return Ok(reject(config.status, config.retry_after.as_ref()));
                    }
                    Err(error) if admits_unlimited(&limits, config.fail_open, &error).await => None,
                    Err(error) => {
                        tracing::error!(semaphore = %limits.name(), %error,
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
                    tracing::warn!(semaphore = %limits.name(), %error,
                        "releasing a request's permit failed");
                }
                response
            }),
        }
    }
}

/// The service instance `poll_ready` made ready, leaving a fresh clone in
/// its place for the next request.
fn take_ready<S: Clone>(service: &mut S) -> S {
    let clone = service.clone();
    std::mem::replace(service, clone)
}

/// Whether a request is served without a limit after `error`
/// ([`SemaphoreLayer::fail_open`]).
async fn admits_unlimited(limits: &Limits, enabled: bool, error: &Error) -> bool {
    let name = limits.name();
    let (pool, family_metrics);
    let metrics = match (&limits.global, &limits.family) {
        (Some(global), _) => {
            pool = global.pool();
            global.metrics()
        }
        (None, Some((family, _))) => {
            pool = family.pool();
            family_metrics = SemaphoreMetrics::new(&name);
            &family_metrics
        }
        (None, None) => return false,
    };
    fail_open::admits(
        enabled,
        error,
        pool,
        Unchecked::Request {
            semaphore: &name,
            metrics,
        },
    )
    .await
}

/// One permit of `global` and `key` together, at once or waiting up to
/// `wait`.
async fn acquire_both(
    global: &Semaphore,
    key: &Semaphore,
    wait: Option<Duration>,
) -> Result<Permit, Error> {
    let both = [(global, 1), (key, 1)];
    let Some(timeout) = wait else {
        return Semaphore::try_acquire_all(&both).await;
    };
    match tokio::time::timeout(timeout, Semaphore::acquire_all(&both)).await {
        Ok(result) => result,
        Err(_) => Err(Error::Timeout {
            waited_for: WaitedFor::Permit {
                semaphore: key.name().to_owned(),
            },
            timeout,
        }),
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

/// Limits how many requests start per unit of time, per key, with a
/// [`RateLimiter`]: each request is one permit of the key a closure reads
/// from its head (a customer, an API key, an address), checked by every
/// process against the same stored state.
///
/// - **refuse** (the default): a request the key does not admit now is
///   answered `429 Too Many Requests` (or [`reject_with`](Self::reject_with))
///   with `Retry-After: <seconds>`, the time until the key admits one,
///   rounded up;
/// - **wait** ([`wait`](Self::wait)): a request the key admits within the
///   bound reserves its permit and waits for it ([`RateLimiter::acquire`]);
///   one it would not is refused as above. A request cancelled while it
///   waits forfeits its reserved permit: the key admits less, never more.
///
/// A request for which the key closure returns `None` is not limited. When
/// the database cannot be reached, requests get `503 Service Unavailable`,
/// unless the limiter was built to fail open
/// ([`RateLimiterBuilder::fail_open`](crate::RateLimiterBuilder::fail_open)).
///
/// ```no_run
/// use std::time::Duration;
/// use pg_semaphore::{Client, RateLimiter, RatePolicy, tower::RateLimitLayer};
///
/// # fn run(client: Client) -> Result<(), Box<dyn std::error::Error>> {
/// // 5 requests per second per customer, bursts of 10.
/// let per_customer =
///     RateLimiter::builder("per-customer", RatePolicy::token_bucket(5.0, 10)).build(&client)?;
/// let layer = RateLimitLayer::new(per_customer, |request| {
///     let customer = request.headers.get("x-customer")?;
///     Some(customer.to_str().ok()?.to_owned())
/// })
/// .wait(Duration::from_millis(500)); // a short wait rather than a 429
/// let app: axum::Router = axum::Router::new()
///     .route("/search", axum::routing::get(|| async { "results" }))
///     .layer(layer);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
#[must_use = "a layer does nothing until it wraps a service"]
pub struct RateLimitLayer {
    limiter: RateLimiter,
    key: KeyFn,
    wait: Option<Duration>,
    status: StatusCode,
}

impl fmt::Debug for RateLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("limiter", &self.limiter.name())
            .field("wait", &self.wait)
            .field("reject_with", &self.status)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayer {
    /// A refusing layer on `limiter`, one permit per request of the key
    /// `key` reads from the request's head.
    pub fn new(
        limiter: RateLimiter,
        key: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        RateLimitLayer {
            limiter,
            key: Arc::new(key),
            wait: None,
            status: StatusCode::TOO_MANY_REQUESTS,
        }
    }

    /// Waits up to `timeout` for the key to admit a request before refusing
    /// it.
    pub fn wait(mut self, timeout: Duration) -> Self {
        self.wait = Some(timeout);
        self
    }

    /// The status of a refused request (default `429 Too Many Requests`).
    /// The body is empty; `Retry-After` is set.
    pub fn reject_with(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimitService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimitService {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service made by [`RateLimitLayer`]; see there.
#[derive(Clone)]
pub struct RateLimitService<S> {
    inner: S,
    layer: RateLimitLayer,
}

impl<S> fmt::Debug for RateLimitService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitService")
            .field("layer", &self.layer)
            .finish_non_exhaustive()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimitService<S>
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
        let mut inner = take_ready(&mut self.inner);
        let layer = self.layer.clone();
        let (parts, body) = request.into_parts();
        let key = (layer.key)(&parts);
        let request = Request::from_parts(parts, body);
        ResponseFuture {
            future: Box::pin(async move {
                if let Some(key) = key {
                    match layer.admit(&key).await {
                        Ok(None) => {}
                        Ok(Some(retry_after)) => {
                            let seconds = retry_after.as_secs_f64().ceil().max(1.0) as u64;
                            return Ok(reject(layer.status, Some(&HeaderValue::from(seconds))));
                        }
                        Err(error) => {
                            tracing::error!(limiter = layer.limiter.name(), %error,
                                "cannot use the rate limiter: rejecting the request");
                            return Ok(reject(StatusCode::SERVICE_UNAVAILABLE, None));
                        }
                    }
                }
                inner.call(request).await
            }),
        }
    }
}

impl RateLimitLayer {
    /// Admits one request of `key`: `None` when admitted, else how long
    /// until the key would admit one.
    async fn admit(&self, key: &str) -> Result<Option<Duration>, Error> {
        if let Some(timeout) = self.wait {
            match self.limiter.acquire_timeout(key, 1, timeout).await {
                Ok(decision) if decision.allowed => return Ok(None),
                Ok(decision) => return Ok(Some(decision.retry_after)),
                // Not within the bound: a check says when (or admits, if
                // the key has refilled meanwhile).
                Err(Error::Timeout { .. }) => {}
                Err(error) => return Err(error),
            }
        }
        let decision = self.limiter.check(key, 1).await?;
        Ok((!decision.allowed).then_some(decision.retry_after))
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

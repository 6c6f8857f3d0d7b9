//! Compile-time checks, as tokio's `bounds` tests: the public types and
//! futures can be shared across threads and spawned. Nothing here runs
//! against a database: if it compiles, it passes.

use std::time::Duration;

use pg_semaphore::{
    Acquiring, Decision, Error, LimiterSet, LostReason, Mutex, MutexGuard, Permit, RateLimiter,
    RateLimiterBuilder, RatePolicy, Semaphore, SemaphoreBuilder, SemaphoreFamily,
    SemaphoreFamilyBuilder, SessionGuard, WaitedFor,
    admin::{LimiterKind, RateLimitSetting, Reaper},
    audit::AuditLog,
};
use sqlx::PgPool;

fn send<T: Send>(_: &T) {}
fn sync<T: Sync>(_: &T) {}
fn unpin<T: Unpin>(_: &T) {}
fn spawnable<T: Send + 'static>(_: &T) {}

#[test]
fn handles_and_guards_are_send_and_sync() {
    fn all<T: Send + Sync + Unpin + std::fmt::Debug>() {}
    all::<Semaphore>();
    all::<SemaphoreBuilder>();
    all::<SemaphoreFamily>();
    all::<SemaphoreFamilyBuilder>();
    all::<Permit>();
    all::<Acquiring<'static>>();
    all::<Mutex>();
    all::<MutexGuard>();
    all::<SessionGuard>();
    all::<Reaper>();
    all::<AuditLog>();
    all::<RateLimiter>();
    all::<RateLimiterBuilder>();
    all::<RatePolicy>();
    all::<LimiterSet>();
    all::<LimiterKind>();
    all::<RateLimitSetting>();
    all::<Decision>();
    all::<LostReason>();
    all::<WaitedFor>();
    // Errors travel in Box<dyn Error + Send + Sync> (anyhow, tokio tasks).
    fn boxed<T: std::error::Error + Send + Sync + 'static>() {}
    boxed::<Error>();
}

/// Every public future can be spawned on a multi-threaded runtime.
#[allow(dead_code, clippy::too_many_arguments)]
fn futures_are_send(
    sem: Semaphore,
    permit: Permit,
    mutex: Mutex,
    pool: PgPool,
    session: SessionGuard,
    bucket: RateLimiter,
    mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
) {
    let second = Duration::from_secs(1);
    send(&Semaphore::builder("s", 1).build(&pg_semaphore::Client::new(pool.clone())));
    send(&sem.try_acquire());
    send(&sem.acquire());
    send(&sem.acquiring().timeout(second).acquire());
    send(&sem.try_acquire_many(2));
    send(&sem.acquiring().timeout(second).acquire_many(2));
    send(&sem.acquiring().metadata(serde_json::json!({})).acquire());
    send(&Semaphore::try_acquire_all(&[(&sem, 1)]));
    send(&Semaphore::acquire_all(&[(&sem, 1)]));
    send(&sem.wait_idle());
    send(&sem.available_permits());
    send(&sem.queue_len());
    send(&permit.lost());
    send(&permit.fence(&mut tx));
    send(&mutex.lock(&pg_semaphore::Client::new(pool.clone())));
    send(
        &mutex
            .locking()
            .timeout(second)
            .lock(&pg_semaphore::Client::new(pool.clone())),
    );
    send(
        &mutex
            .locking()
            .no_wait()
            .lock(&pg_semaphore::Client::new(pool.clone())),
    );
    send(
        &mutex
            .locking()
            .lock_session(&pg_semaphore::Client::new(pool.clone())),
    );
    send(
        &mutex
            .locking()
            .shared()
            .no_wait()
            .lock_session(&pg_semaphore::Client::new(pool.clone())),
    );
    send(&mutex.locking().no_wait().lock_in(&mut tx));
    send(
        &mutex
            .locking()
            .with_lock(&pg_semaphore::Client::new(pool.clone()), |conn| {
                Box::pin(async move {
                    sqlx::query("SELECT 1").execute(conn).await?;
                    Ok::<_, pg_semaphore::Error>(())
                })
            }),
    );
    spawnable(&session.lost());
    unpin(&Box::pin(session.lost()));
    send(&session.unlock());
    send(&bucket.check("key", 1));
    send(&bucket.acquire("key", 1));
    send(&bucket.acquire_timeout("key", 1, second));
    send(&bucket.pause("key", second));
    send(&bucket.pause_all(second));
    let set = LimiterSet::new().with(&bucket);
    send(&set.check("key", 1));
    send(&pg_semaphore::admin::rate_limit_settings(&pool));
    send(&pg_semaphore::admin::set_rate_limit(
        &pool,
        "b",
        None,
        RatePolicy::token_bucket(1.0, 1),
    ));
    send(&pg_semaphore::admin::resume_rate_limit(
        &pool,
        LimiterKind::TokenBucket,
        "b",
        None,
    ));
    send(&pg_semaphore::migrate(&pool));
    send(&pg_semaphore::admin::reap(&pool));
    send(&pg_semaphore::admin::semaphores(&pool));
    send(&pg_semaphore::admin::set_capacity(&pool, "s", 2));
    send(&permit.release());
    sync(&sem);
}

/// A family's futures can be spawned too.
#[allow(dead_code)]
fn family_futures_are_send(family: SemaphoreFamily, pool: PgPool) {
    send(&SemaphoreFamily::builder("f", 1).build(&pg_semaphore::Client::new(pool.clone())));
    send(&family.key("k"));
    send(&family.try_acquire("k"));
    send(&family.acquire("k"));
    send(&pg_semaphore::admin::families(&pool));
    send(&pg_semaphore::admin::busiest_keys(&pool, "f", 10));
    send(&pg_semaphore::admin::set_family_rule(
        &pool,
        "f",
        pg_semaphore::admin::RuleKind::Key,
        "k",
        Some(1),
    ));
}

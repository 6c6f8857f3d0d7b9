//! What a process keeps once per pool: a service shared by every handle
//! built on the same connect options ([`PerPool`]: the wake-ups' `LISTEN`
//! connection, the advisory semaphores' sessions, their audit writer), and
//! the poison-tolerant [`lock`] such state is kept under.

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use sqlx::postgres::PgConnectOptions;

/// One `T` per connect options, by the identity of their `Arc` (a pool's,
/// or one a handle was given), held weakly: it ends when the last handle
/// that uses it drops it, and the next handle makes a new one.
pub(crate) struct PerPool<T>(Mutex<Vec<(Arc<PgConnectOptions>, Weak<T>)>>);

impl<T> PerPool<T> {
    pub(crate) const fn new() -> Self {
        PerPool(Mutex::new(Vec::new()))
    }

    /// The live `T` for `options`, or the one `make` makes now (under the
    /// registry's lock, so two callers never make two).
    pub(crate) fn get(
        &self,
        options: &Arc<PgConnectOptions>,
        make: impl FnOnce() -> Arc<T>,
    ) -> Arc<T> {
        let mut registry = lock(&self.0);
        registry.retain(|(_, made)| made.strong_count() > 0);
        if let Some(made) = registry
            .iter()
            .find(|(o, _)| Arc::ptr_eq(o, options))
            .and_then(|(_, made)| made.upgrade())
        {
            return made;
        }
        let made = make();
        registry.push((options.clone(), Arc::downgrade(&made)));
        made
    }
}

/// Locks a mutex, recovering from poisoning: the data kept under these
/// locks stays consistent because no code panics while holding them.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

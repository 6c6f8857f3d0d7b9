//! Cancel safety by construction: [`detached`] runs a round trip so that a
//! caller who goes away never loses what it did (a claim is released, a
//! queue place left, a lock wait cancelled): the one "undo if the caller is
//! gone" used by the semaphore, the queue and the mutex.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;

use tokio::sync::oneshot;

use crate::error::{Error, Result};

/// Resolves when the caller of a [`detached`] round trip has gone (its
/// future was dropped).
pub(crate) struct CallerGone(oneshot::Receiver<Infallible>);

impl CallerGone {
    pub(crate) async fn wait(&mut self) {
        // Nothing is ever sent: this returns when the sender is dropped.
        let _ = (&mut self.0).await;
    }
}

/// Runs `round_trip` and returns its result, cancel-safe by construction:
/// it is polled in the caller's task (no spawn, no thread hop on the common
/// path), and if the caller's future is dropped before it finished, the rest
/// of the round trip is handed to a spawned task, which finishes it and
/// drops what it produced: values that hold something (a
/// [`Permit`](crate::Permit), a queue ticket, a mutex guard) give it back in
/// their `Drop`. The round trip can watch [`CallerGone`] to stop early (a
/// lock wait cancels its statement on the server).
pub(crate) fn detached<T, F>(round_trip: impl FnOnce(CallerGone) -> F) -> Detached<T>
where
    T: Send + 'static,
    F: Future<Output = Result<T>> + Send + 'static,
{
    let (alive, gone) = oneshot::channel::<Infallible>();
    Detached {
        work: Some(Box::pin(round_trip(CallerGone(gone)))),
        alive: Some(alive),
    }
}

/// A round trip in flight; see [`detached`].
pub(crate) struct Detached<T: Send + 'static> {
    work: Option<Pin<Box<dyn Future<Output = Result<T>> + Send>>>,
    /// Dropped when the caller goes away: [`CallerGone`] resolves.
    alive: Option<oneshot::Sender<Infallible>>,
}

impl<T: Send + 'static> Future for Detached<T> {
    type Output = Result<T>;

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<T>> {
        let Some(work) = self.work.as_mut() else {
            return std::task::Poll::Ready(Err(caller_gone()));
        };
        let result = std::task::ready!(work.as_mut().poll(cx));
        self.work = None;
        std::task::Poll::Ready(result)
    }
}

impl<T: Send + 'static> Drop for Detached<T> {
    fn drop(&mut self) {
        let Some(work) = self.work.take() else {
            return;
        };
        drop(self.alive.take());
        match tokio::runtime::Handle::try_current() {
            // What it produces is dropped there, which undoes it.
            Ok(runtime) => drop(runtime.spawn(async move { drop(work.await) })),
            Err(_) => tracing::debug!("a round trip was abandoned outside a tokio runtime"),
        }
    }
}

/// What a round trip returns when its caller has gone: nobody ever sees it.
pub(crate) fn caller_gone() -> Error {
    Error::internal("the caller of this round trip has gone")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::outcome_unknown;

    #[test]
    fn an_internal_error_is_never_an_outage() {
        let error = Error::internal("pgsemaphore.claim returned a claim without ids");
        assert!(!error.is_unreachable());
        assert!(!outcome_unknown(&error));
        assert!(!error.is_busy());
        assert!(!outcome_unknown(&caller_gone()));
    }
}

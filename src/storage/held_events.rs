//! The events a batch attempt of a server-database backend emitted, held in memory until its
//! COMMIT. A job's events are held in the order emitted; a job rolled back to its savepoint takes
//! its own back. Just before COMMIT the backend inserts what is left, numbered
//! ([`super::batcher::SqlBackend::seal`]): it bumps each tenant's `event_seqs` row by its count
//! and holds that row until the commit. A tenant's next transaction waits there, so its events
//! commit in sequence order and a reader paging `seq > after` never misses one that commits later
//! with a lower number. The row is taken after every resource row the transaction locks, so no
//! lock cycle runs through it.
//!
//! Why held rather than inserted unnumbered and numbered at the end: the numbering UPDATE wrote
//! every event row twice (on PostgreSQL a new version that is never heap-only, since `seq` is
//! indexed), with a second entry in each of its indexes.

use std::cell::RefCell;
use std::future::Future;

use crate::events::NewEvent;
use crate::storage::StorageError;

tokio::task_local! {
    /// The events a batch attempt emitted so far, in the order emitted.
    static WRITTEN: RefCell<Vec<NewEvent>>;
}

/// Runs a batch attempt with an empty list of held events.
pub(crate) fn scope<F: Future>(attempt: F) -> impl Future<Output = F::Output> {
    WRITTEN.scope(RefCell::new(Vec::new()), attempt)
}

/// Holds events the current batch attempt emitted (in its transaction) until it seals.
pub(crate) fn hold(events: &[NewEvent]) -> Result<(), StorageError> {
    WRITTEN
        .try_with(|w| w.borrow_mut().extend_from_slice(events))
        .map_err(|_| StorageError::Internal("an event was written outside a batch".into()))
}

/// The payload of an event the current attempt holds (not inserted yet), by its id.
pub(crate) fn held_data(id: &str) -> Option<String> {
    WRITTEN.try_with(|w| w.borrow().iter().find(|e| e.id == id).map(|e| e.data.clone())).ok().flatten()
}

/// Where the attempt's events stand (before a job's savepoint).
pub(crate) fn mark() -> usize {
    WRITTEN.try_with(|w| w.borrow().len()).unwrap_or(0)
}

/// Forgets the events written since `mark` (their savepoint rolled back).
pub(crate) fn rollback_to(mark: usize) {
    let _ = WRITTEN.try_with(|w| w.borrow_mut().truncate(mark));
}

/// Takes the attempt's held events to insert them: a seal that fails fails its attempt, and a
/// rerun starts from an empty list.
pub(crate) fn take() -> Vec<NewEvent> {
    WRITTEN.try_with(|w| std::mem::take(&mut *w.borrow_mut())).unwrap_or_default()
}

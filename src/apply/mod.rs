//! Every state change stockd makes on the database, written once: orders (one by one, or a
//! batch by admission), reservation moves, adjustments, resource creation, buckets, and the
//! settlement of sales Redis made. The rules live here and in [`crate::engine`]; each backend
//! implements only [`port::Port`], the statements these need, with SQL text and plumbing.
//!
//! A backend runs these inside its group commit: each write in its own savepoint of one
//! transaction, on the batch's connection. PostgreSQL drives them as async code; SQLite's writer
//! thread drives them to completion at once with [`port::run_now`].

pub mod batch;
pub mod buckets;
pub mod events;
pub mod orders;
pub mod port;
pub mod reads;
pub mod reservations;
pub mod resources;
pub mod reversals;
pub mod settlement;

#[cfg(test)]
mod reconcile_tests;
#[cfg(test)]
mod settlement_tests;
#[cfg(test)]
mod tests;

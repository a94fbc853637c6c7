//! The domain: newtypes, plans, orders, resources, reservations and the ledger's arithmetic.
//! Everything here is pure (no I/O, time passed in), so every storage backend applies exactly
//! the same rules and the rules are unit-tested without a database.

pub mod admission;
pub mod buckets;
pub mod order;
pub mod plan;
pub mod resource;
pub mod reversal;
pub mod types;

pub use order::{LineResult, OrderDocument, OrderRequest, OrderStatus, Reason};
pub use plan::{DefaultPlanner, LimitSpec, PartialPolicy, Plan, PlanError, PlannedLine, Planner, PlannerRef, Target};
pub use resource::{
    reconcile, BucketCounts, BucketTake, Checkpoint, CheckpointUpdate, Counters, Drift, LedgerEntry, LedgerSum,
    NewestEntry, Pass, Reconciliation, Reservation, ReservationLine, ResourceState,
};
pub use types::*;

//! Stored outcomes read in groups. Every order routed to Redis first reads its key's stored
//! outcome ([`crate::pipeline`]); on a database server each such read is a statement of its own
//! (a round trip, a parse-bind-execute, a snapshot), which under a flash sale cost PostgreSQL
//! more than the sales' settlement. Lookups that wait together are read by one statement
//! instead: a task takes every lookup queued (up to [`MAX_GROUP`]) and answers each from the
//! group's rows. No lookup waits for a group to fill: a task that is free reads whatever is
//! queued at once, so under light load a group is one lookup.
//!
//! Each lookup is still read after it was asked (the group's statement starts after every one
//! of its lookups was queued), so it sees every answer committed before it was asked, as a read
//! of its own would. A failed statement fails the lookups of its group only.

use std::sync::Arc;

use futures::future::BoxFuture;
use tokio::sync::{mpsc, oneshot, Mutex};

use super::{IdempotencyRequest, Idempotent, StorageError, StoredResponse};
use crate::engine::TenantId;

/// The most lookups one statement reads.
const MAX_GROUP: usize = 256;
/// Lookups queued beyond this wait to be queued (the request waits, nothing is dropped).
const QUEUE_DEPTH: usize = 4096;

/// A key's stored record as the group's statement read it: its request hash and response.
pub(crate) type Found = Result<Option<(String, StoredResponse)>, StorageError>;

/// Reads the records of `(tenant, key)` pairs in one statement: one [`Found`] per pair, in
/// their order.
pub(crate) type ReadGroup =
    Arc<dyn Fn(Vec<(String, String)>) -> BoxFuture<'static, Result<Vec<Found>, StorageError>> + Send + Sync>;

struct Lookup {
    tenant: String,
    idem: IdempotencyRequest,
    reply: oneshot::Sender<Result<Option<Idempotent>, StorageError>>,
}

/// The queue of lookups and the tasks that read them in groups; the tasks end when this is
/// dropped and the queue is empty.
pub(crate) struct Lookups {
    tx: mpsc::Sender<Lookup>,
}

impl Lookups {
    /// Starts `readers` tasks, each reading one group at a time with `read` (so at most
    /// `readers` statements, and connections, at once). Must run inside a Tokio runtime.
    pub(crate) fn start(readers: usize, read: ReadGroup) -> Self {
        let (tx, rx) = mpsc::channel(QUEUE_DEPTH);
        let rx = Arc::new(Mutex::new(rx));
        for _ in 0..readers.max(1) {
            tokio::spawn(serve(rx.clone(), read.clone()));
        }
        Self { tx }
    }

    /// The outcome stored under the request's key, judged against the request.
    pub(crate) async fn lookup(
        &self,
        tenant: &TenantId,
        idem: &IdempotencyRequest,
    ) -> Result<Option<Idempotent>, StorageError> {
        let (reply, answer) = oneshot::channel();
        let lookup = Lookup { tenant: tenant.to_string(), idem: idem.clone(), reply };
        self.tx.send(lookup).await.map_err(|_| StorageError::Unavailable("shutting down".into()))?;
        answer.await.map_err(|_| StorageError::Unavailable("the lookup was not read".into()))?
    }
}

/// One reader: takes the first lookup queued and every one behind it, reads them, answers them.
async fn serve(rx: Arc<Mutex<mpsc::Receiver<Lookup>>>, read: ReadGroup) {
    loop {
        let mut group = Vec::new();
        {
            let mut rx = rx.lock().await;
            let Some(first) = rx.recv().await else { return };
            group.push(first);
            while group.len() < MAX_GROUP {
                match rx.try_recv() {
                    Ok(next) => group.push(next),
                    Err(_) => break,
                }
            }
        }
        // A request that went away no longer needs its key read.
        group.retain(|l| !l.reply.is_closed());
        if group.is_empty() {
            continue;
        }
        metrics::histogram!("stockd_lookup_group_size").record(group.len() as f64);
        let keys = group.iter().map(|l| (l.tenant.clone(), l.idem.key.to_string())).collect();
        match read(keys).await {
            // One answer per lookup, in order (a lookup left without one has its reply dropped,
            // which answers it `Unavailable`).
            Ok(found) => {
                for (lookup, found) in group.into_iter().zip(found) {
                    let judged = found.map(|f| f.map(|(hash, response)| lookup.idem.judge(&hash, response)));
                    let _ = lookup.reply.send(judged);
                }
            }
            Err(err) => {
                for lookup in group {
                    let _ = lookup.reply.send(Err(err.clone()));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::ContentType;

    fn request(key: &str, hash: &str) -> IdempotencyRequest {
        IdempotencyRequest {
            key: crate::engine::IdempotencyKey::parse(key.to_string()).expect("a valid key"),
            request_hash: hash.to_string(),
        }
    }

    fn response(body: &str) -> StoredResponse {
        StoredResponse { status: 201, content_type: ContentType::Json, body: body.to_string() }
    }

    /// A record keeps the hash's first 32 digits; one an earlier version wrote keeps all 64.
    /// Either judges a replay as the same request, and a hash that differs in any digit the
    /// record kept as another one.
    #[test]
    fn a_record_judges_by_half_the_hash_or_by_the_whole_one_it_kept_before() {
        let whole = "0123456789abcdef".repeat(4);
        assert_eq!(crate::storage::stored_hash(&whole), &whole[..32]);
        let replayed = Idempotent::Replayed(response("{}"));
        let r = request("k", &whole);
        assert_eq!(r.judge(&whole[..32], response("{}")), replayed);
        assert_eq!(r.judge(&whole, response("{}")), replayed);
        let last_kept_digit_differs = format!("{}0", &whole[..31]);
        assert_eq!(r.judge(&last_kept_digit_differs, response("{}")), Idempotent::Mismatch);
        let second_half_differs = format!("{}{}", &whole[..32], "f".repeat(32));
        assert_eq!(r.judge(&second_half_differs, response("{}")), Idempotent::Mismatch);
    }

    /// Lookups queued while a group is being read are read together by the next statement, and
    /// each gets the answer of its own tenant and key (a mismatch where the hash differs).
    #[tokio::test]
    async fn lookups_queued_behind_a_read_share_the_next_statement() {
        let groups = Arc::new(std::sync::Mutex::new(Vec::<Vec<(String, String)>>::new()));
        let (release, released) = tokio::sync::watch::channel(false);
        let seen = groups.clone();
        let read: ReadGroup = Arc::new(move |keys: Vec<(String, String)>| {
            let (seen, mut released) = (seen.clone(), released.clone());
            Box::pin(async move {
                let first = seen.lock().map(|mut g| {
                    g.push(keys.clone());
                    g.len() == 1
                });
                if first.unwrap_or(false) {
                    // The first statement is slow: everything asked meanwhile queues.
                    let _ = released.wait_for(|r| *r).await;
                }
                Ok(keys
                    .iter()
                    .map(|(tenant, key)| match key.as_str() {
                        "missing" => Ok(None),
                        _ => Ok(Some((format!("hash-of-{tenant}"), response(&format!("{tenant}/{key}"))))),
                    })
                    .collect())
            })
        });
        let lookups = Arc::new(Lookups::start(1, read));
        let first = {
            let lookups = lookups.clone();
            tokio::spawn(async move {
                lookups.lookup(&TenantId::parse("t0".to_string()).expect("tenant"), &request("k0", "hash-of-t0")).await
            })
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while groups.lock().map(|g| g.is_empty()).unwrap_or(true) {
            assert!(std::time::Instant::now() < deadline, "the first lookup was never read");
            tokio::task::yield_now().await;
        }
        let mut asked = Vec::new();
        for i in 1..=50 {
            let lookups = lookups.clone();
            let (tenant, key, hash) = match i {
                1 => ("t1", "missing".to_string(), "hash-of-t1"),
                2 => ("t2", "k0".to_string(), "some-other-request"),
                _ => (
                    if i % 2 == 0 { "t1" } else { "t2" },
                    format!("k{i}"),
                    if i % 2 == 0 { "hash-of-t1" } else { "hash-of-t2" },
                ),
            };
            let (tenant, key, hash) = (tenant.to_string(), key, hash.to_string());
            asked.push((
                tenant.clone(),
                key.clone(),
                tokio::spawn(async move {
                    lookups.lookup(&TenantId::parse(tenant.clone()).expect("tenant"), &request(&key, &hash)).await
                }),
            ));
        }
        // Every one of the 50 is queued once the queue holds them; then the first read ends.
        while lookups.tx.capacity() > QUEUE_DEPTH - 50 {
            assert!(std::time::Instant::now() < deadline, "the lookups were never queued");
            tokio::task::yield_now().await;
        }
        let _ = release.send(true);
        let first = first.await.expect("the first lookup's task").expect("the first lookup");
        assert_eq!(first, Some(Idempotent::Replayed(response("t0/k0"))));
        for (tenant, key, task) in asked {
            let got = task.await.expect("a lookup's task").expect("a lookup");
            let want = match key.as_str() {
                "missing" => None,
                "k0" => Some(Idempotent::Mismatch),
                _ => Some(Idempotent::Replayed(response(&format!("{tenant}/{key}")))),
            };
            assert_eq!(got, want, "{tenant}/{key}");
        }
        let sizes: Vec<usize> = groups.lock().map(|g| g.iter().map(Vec::len).collect()).unwrap_or_default();
        assert_eq!(sizes, vec![1, 50], "lookups queued behind a read share one statement");
    }
}

//! The sold-out short-circuit. When a resource's Redis stock reaches zero, the deduct script
//! publishes it on the prefix's channel; every process listens and remembers the resource as
//! sold out until a warm (a restock warms) publishes stock again. While some of its sales are
//! not yet settled into the database, an order on it costs one read of Redis's record of its
//! key (a retry of an unsettled sale gets its first answer, not `sold_out`). Once the last one
//! is settled (the acknowledging script announces it), the database holds every sale, which the
//! pipeline's lookup finds first, and orders are answered `sold_out` from memory, without a Redis
//! round trip. A process that missed a message (it started later, or its subscription was down)
//! learns the same from its own next script reply or record read.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::RedisMode;

/// What a process knows of a resource's stock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mark {
    /// Stock again (a warm or a restock loaded some, a release gave some back).
    InStock,
    /// Redis sold the last unit; some sales may not be in the database yet.
    SoldOut,
    /// Sold out, and every sale of it is in the database.
    Settled,
}

/// The resources this process knows to be sold out, and whether their sales are all settled.
#[derive(Default)]
pub struct SoldOut {
    keys: RwLock<HashMap<(String, String), bool>>,
}

impl SoldOut {
    /// `None`: not known to be sold out; `Some(settled)` otherwise.
    pub fn state(&self, tenant: &str, key: &str) -> Option<bool> {
        self.keys.read().ok().and_then(|k| k.get(&(tenant.to_string(), key.to_string())).copied())
    }

    pub fn mark(&self, tenant: &str, key: &str, mark: Mark) {
        if let Ok(mut keys) = self.keys.write() {
            let id = (tenant.to_string(), key.to_string());
            match mark {
                Mark::InStock => {
                    keys.remove(&id);
                }
                Mark::SoldOut => {
                    keys.insert(id, false);
                }
                Mark::Settled => {
                    keys.insert(id, true);
                }
            }
        }
    }

    /// Forgets every mark: after the subscription was down, any of them may be stale.
    fn clear(&self) {
        if let Ok(mut keys) = self.keys.write() {
            keys.clear();
        }
    }
}

/// The announcement: `0 tenant key` sold out, `1 tenant key` in stock, `2 tenant key` sold out
/// and settled. Tenant ids hold no space.
pub fn message(mark: Mark, tenant: &str, key: &str) -> String {
    let flag = match mark {
        Mark::SoldOut => 0,
        Mark::InStock => 1,
        Mark::Settled => 2,
    };
    format!("{flag} {tenant} {key}")
}

fn parse(message: &str) -> Option<(Mark, &str, &str)> {
    let mut parts = message.splitn(3, ' ');
    let mark = match parts.next()? {
        "0" => Mark::SoldOut,
        "2" => Mark::Settled,
        _ => Mark::InStock,
    };
    let tenant = parts.next()?;
    let key = parts.next()?;
    Some((mark, tenant, key))
}
/// Listens to the channel until shutdown, resubscribing (and forgetting every mark, which may
/// have missed a restock meanwhile, when it drops and again once it is back) whenever the
/// subscription drops.
pub fn spawn(hot: Arc<RedisMode>, mut shutdown: watch::Receiver<bool>) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                result = listen(&hot) => {
                    if let Err(err) = result {
                        tracing::debug!(error = %err, "sold-out subscription dropped; resubscribing");
                    }
                }
                _ = shutdown.changed() => return,
            }
            hot.sold_out.clear();
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                _ = shutdown.changed() => return,
            }
        }
    })
}

async fn listen(hot: &RedisMode) -> redis::RedisResult<()> {
    let client = hot.link().pubsub_client().await?;
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(hot.channel()).await?;
    // A mark set while the subscription was down (by this process's own sales) may have missed
    // the announcement that cleared it (a release, an expiry): forget them now that every later
    // announcement arrives.
    hot.sold_out.clear();
    let mut messages = pubsub.on_message();
    while let Some(msg) = messages.next().await {
        let payload: String = msg.get_payload()?;
        if let Some((mark, tenant, key)) = parse(&payload) {
            hot.sold_out.mark(tenant, key, mark);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn announcements_round_trip() {
        assert_eq!(parse(&message(Mark::SoldOut, "shop", "sku:1")), Some((Mark::SoldOut, "shop", "sku:1")));
        assert_eq!(parse(&message(Mark::InStock, "shop", "a b")), Some((Mark::InStock, "shop", "a b")));
        assert_eq!(parse(&message(Mark::Settled, "shop", "k")), Some((Mark::Settled, "shop", "k")));
        assert_eq!(parse("x"), None);
    }
}

//! The sold-out short-circuit. When a resource's Redis stock reaches zero, the deduct script
//! publishes it on the prefix's channel; every process listens and remembers the resource as
//! sold out, answering its orders `sold_out` from memory, without a Redis round trip, until a
//! warm (a restock warms) publishes stock again. A process that missed the message (it started
//! later, or its subscription was down) learns the same from its own next script reply.

use std::collections::HashSet;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::Hotpath;

/// The resources this process knows to be sold out.
#[derive(Default)]
pub struct SoldOut {
    keys: RwLock<HashSet<(String, String)>>,
}

impl SoldOut {
    pub fn contains(&self, tenant: &str, key: &str) -> bool {
        self.keys.read().map(|k| k.contains(&(tenant.to_string(), key.to_string()))).unwrap_or(false)
    }

    pub fn set(&self, tenant: &str, key: &str, sold_out: bool) {
        if let Ok(mut keys) = self.keys.write() {
            let id = (tenant.to_string(), key.to_string());
            if sold_out {
                keys.insert(id);
            } else {
                keys.remove(&id);
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

/// The announcement: `0 tenant key` sold out, `1 tenant key` in stock. Tenant ids hold no space.
pub fn message(sold_out: bool, tenant: &str, key: &str) -> String {
    format!("{} {tenant} {key}", if sold_out { 0 } else { 1 })
}

fn parse(message: &str) -> Option<(bool, &str, &str)> {
    let mut parts = message.splitn(3, ' ');
    let flag = parts.next()?;
    let tenant = parts.next()?;
    let key = parts.next()?;
    Some((flag == "0", tenant, key))
}

/// Listens to the channel until shutdown, resubscribing (and forgetting every mark, which may
/// have missed a restock meanwhile) whenever the subscription drops.
pub fn spawn(hot: Arc<Hotpath>, mut shutdown: watch::Receiver<bool>) -> JoinHandle<()> {
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

async fn listen(hot: &Hotpath) -> redis::RedisResult<()> {
    let client = hot.link().pubsub_client().await?;
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(hot.channel()).await?;
    let mut messages = pubsub.on_message();
    while let Some(msg) = messages.next().await {
        let payload: String = msg.get_payload()?;
        if let Some((sold_out, tenant, key)) = parse(&payload) {
            hot.sold_out.set(tenant, key, sold_out);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn announcements_round_trip() {
        assert_eq!(parse(&message(true, "shop", "sku:1")), Some((true, "shop", "sku:1")));
        assert_eq!(parse(&message(false, "shop", "a b")), Some((false, "shop", "a b")));
        assert_eq!(parse("x"), None);
    }
}

//! `redis-lua`: the classic Redis Lua pre-deduction design, run by the bench process itself
//! like the other baselines ([`super::baseline`]), not through stockd. Each request is one Lua
//! script ([`TAKE`], loaded once with `SCRIPT LOAD` and called by its SHA with `EVALSHA`) on the
//! hot SKU's stock key: when the stock covers the quantity it is decremented and the order
//! (request id, qty) appended to a stream, the asynchronous queue from which the classic design
//! settles orders into the database later (not done here: the bench measures the hot path the
//! design is chosen for); otherwise the order is refused as sold out.
//!
//! Its stock follows the `segmented` baseline's sales: [`UNITS_PER_SALE`] units per sale (as
//! many as `segmented` stocks over its segments), and the client that finds the stock gone
//! starts the next sale with [`NEXT_SALE`], which moves the sale counter on only from the sale
//! that refusal saw, so the stock is refilled once per sale and the clients keep selling for
//! the whole duration.
//!
//! It needs the Redis at `STOCKD_REDIS_URL` and keeps its keys under a prefix of its own,
//! random per run (`stockd-bench-lua-<hex>:`), deleted at the end. The invariants checked on
//! Redis afterwards: the stock is not negative (nothing oversold), the units stocked are whole
//! sales, units stocked - units left == acknowledged sales == the stream's length (one entry
//! per sale, each of [`QTY`]).

use std::time::Duration;

use anyhow::{bail, Context};
use redis::aio::MultiplexedConnection;
use redis::AsyncConnectionConfig;

use super::baseline::{self, Outcome, Report, Run, SEGMENTS, SOLD_OUT, UNITS_PER_SEGMENT};
use super::server::random_hex;

/// The scenario's name.
pub const NAME: &str = "redis-lua";
/// The environment variable naming the Redis the scenario runs on.
pub const REDIS_URL_ENV: &str = "STOCKD_REDIS_URL";
/// Units stocked at the start of each sale: a `segmented` sale's.
pub const UNITS_PER_SALE: i64 = SEGMENTS * UNITS_PER_SEGMENT;
/// Units each order takes: the hot-key shape.
pub const QTY: i64 = 1;
/// How long connecting to Redis, and then each answer, may take before the request fails.
const REDIS_TIMEOUT: Duration = Duration::from_secs(30);

/// Takes one order from the stock, or refuses it.
///
/// KEYS[1] the SKU's stock: units left in the sale under way
/// KEYS[2] the order stream, the queue the classic design settles into the database from
/// KEYS[3] the sale counter
///
/// ARGV[1] the request id; ARGV[2] qty
///
/// Returns `{1, sale}` when the units were taken and the order queued, `{0, sale}` when the
/// stock does not cover them (sold out), `sale` being the sale under way.
pub const TAKE: &str = r"
local qty = tonumber(ARGV[2])
local stock = tonumber(redis.call('GET', KEYS[1]) or '0')
local sale = tonumber(redis.call('GET', KEYS[3]) or '0')
if stock >= qty then
  redis.call('DECRBY', KEYS[1], qty)
  redis.call('XADD', KEYS[2], '*', 'request', ARGV[1], 'qty', ARGV[2])
  return {1, sale}
end
return {0, sale}
";

/// Starts the next sale unless another client already did.
///
/// KEYS[1] the SKU's stock; KEYS[2] the sale counter; KEYS[3] the units stocked over all sales
///
/// ARGV[1] the sale the refusal saw sold out; ARGV[2] units per sale
///
/// Returns 1 when it started the sale, 0 when the counter had already moved on.
pub const NEXT_SALE: &str = r"
if tonumber(redis.call('GET', KEYS[2]) or '0') ~= tonumber(ARGV[1]) then
  return 0
end
redis.call('INCR', KEYS[2])
redis.call('INCRBY', KEYS[3], ARGV[2])
redis.call('INCRBY', KEYS[1], ARGV[2])
return 1
";

/// The scenario's keys under this run's prefix.
#[derive(Debug, Clone)]
struct Keys {
    stock: String,
    orders: String,
    sale: String,
    stocked: String,
}

impl Keys {
    fn new() -> Self {
        let prefix = format!("stockd-bench-lua-{}:", random_hex(6));
        Self {
            stock: format!("{prefix}hot:stock"),
            orders: format!("{prefix}hot:orders"),
            sale: format!("{prefix}hot:sale"),
            stocked: format!("{prefix}hot:stocked"),
        }
    }

    fn all(&self) -> [&str; 4] {
        [&self.stock, &self.orders, &self.sale, &self.stocked]
    }
}

/// The SHAs of the loaded scripts.
#[derive(Debug, Clone)]
struct Shas {
    take: String,
    next_sale: String,
}

/// The Redis URL of the scenario, from [`REDIS_URL_ENV`]; an error that says how to set it.
pub fn redis_url_from_env() -> anyhow::Result<String> {
    match std::env::var(REDIS_URL_ENV) {
        Ok(url) if !url.trim().is_empty() => Ok(url),
        _ => bail!("the {NAME} scenario needs Redis: set {REDIS_URL_ENV} (e.g. redis://127.0.0.1:6379)"),
    }
}

/// Stocks the first sale on the Redis at `url`, runs `clients` closed loops of one Lua script
/// per order for `duration`, checks the invariants on Redis and deletes the scenario's keys.
pub async fn run(url: &str, clients: usize, duration: Duration) -> anyhow::Result<Run> {
    let client = redis::Client::open(url).with_context(|| format!("{REDIS_URL_ENV} {url:?}"))?;
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(REDIS_TIMEOUT))
        .set_response_timeout(Some(REDIS_TIMEOUT));
    let mut con = client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .with_context(|| format!("connecting to Redis at {url} for {NAME}"))?;
    let keys = Keys::new();
    let outcome = setup_run_check(&mut con, &keys, clients, duration).await;
    let cleanup: redis::RedisResult<i64> = redis::cmd("DEL").arg(&keys.all()[..]).query_async(&mut con).await;
    let run = outcome?;
    cleanup.with_context(|| format!("deleting {NAME}'s keys"))?;
    Ok(run)
}

async fn setup_run_check(
    con: &mut MultiplexedConnection,
    keys: &Keys,
    clients: usize,
    duration: Duration,
) -> anyhow::Result<Run> {
    let load = |src: &'static str| {
        let mut con = con.clone();
        async move { redis::cmd("SCRIPT").arg("LOAD").arg(src).query_async::<String>(&mut con).await }
    };
    let shas = Shas {
        take: load(TAKE).await.context("loading the take script")?,
        next_sale: load(NEXT_SALE).await.context("loading the next-sale script")?,
    };
    redis::pipe()
        .atomic()
        .set(&keys.stock, UNITS_PER_SALE)
        .set(&keys.sale, 1)
        .set(&keys.stocked, UNITS_PER_SALE)
        .query_async::<()>(con)
        .await
        .context("stocking the first sale")?;

    let (shared, keys_shared, shas_shared) = (con.clone(), keys.clone(), shas.clone());
    let stats = baseline::drive(NAME, 1, clients, duration, move |request_id, _segment| {
        let (mut con, keys, shas) = (shared.clone(), keys_shared.clone(), shas_shared.clone());
        async move { once(&mut con, &keys, &shas, &request_id).await.map_err(|e| reason(&e)) }
    })
    .await?;
    if stats.requests == 0 {
        bail!("the {NAME} baseline made no requests");
    }

    let (left, sales, stocked, streamed): (i64, i64, i64, i64) = redis::pipe()
        .get(&keys.stock)
        .get(&keys.sale)
        .get(&keys.stocked)
        .xlen(&keys.orders)
        .query_async(con)
        .await
        .context("reading the scenario's keys")?;
    let sold_outs = stats.rejections.get(SOLD_OUT).copied().unwrap_or(0);
    let tally = Tally { left, sales, stocked, streamed };
    let violations = invariants(&tally, stats.consumed_expected, sold_outs);
    let report = Report {
        segments: 1,
        units_per_segment: UNITS_PER_SALE,
        sales,
        units_stocked: stocked,
        false_sold_outs: 0,
        sold_outs,
    };
    Ok(Run { stats, violations, report })
}

/// One order: the take script; refused, the next sale from the sale it saw.
async fn once(
    con: &mut MultiplexedConnection,
    keys: &Keys,
    shas: &Shas,
    request_id: &str,
) -> redis::RedisResult<Outcome> {
    let (taken, sale): (i64, i64) =
        evalsha(&shas.take, [&keys.stock, &keys.orders, &keys.sale]).arg(request_id).arg(QTY).query_async(con).await?;
    if taken == 1 {
        return Ok(Outcome::Sold);
    }
    evalsha(&shas.next_sale, [&keys.stock, &keys.sale, &keys.stocked])
        .arg(sale)
        .arg(UNITS_PER_SALE)
        .query_async::<i64>(con)
        .await?;
    Ok(Outcome::SoldOut)
}

/// `EVALSHA sha 3 keys...`, to which the caller adds the script's ARGV.
fn evalsha(sha: &str, keys: [&str; 3]) -> redis::Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(sha).arg(keys.len()).arg(&keys[..]);
    cmd
}

/// The reason a failed request is counted under.
fn reason(e: &redis::RedisError) -> String {
    if e.is_timeout() {
        "timeout".into()
    } else {
        "redis_error".into()
    }
}

/// The scenario's keys after its run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Tally {
    /// Units left in the stock key.
    left: i64,
    /// The sale counter: the first sale plus one per sold-out that started the next.
    sales: i64,
    /// Units stocked over all sales.
    stocked: i64,
    /// Entries in the order stream.
    streamed: i64,
}

/// The violations of the scenario's invariants, given the units the acknowledged sales took and
/// the sold-outs answered.
fn invariants(t: &Tally, consumed_expected: i64, sold_outs: u64) -> Vec<String> {
    let mut problems = Vec::new();
    if t.left < 0 {
        problems.push(format!("stock {} is negative: oversold", t.left));
    }
    if t.sales < 1 || t.stocked != t.sales * UNITS_PER_SALE {
        problems.push(format!("stocked {} is not {} sales of {UNITS_PER_SALE}", t.stocked, t.sales));
    }
    let sold_outs = i64::try_from(sold_outs).unwrap_or(i64::MAX);
    if t.sales - 1 > sold_outs {
        problems.push(format!("{} sales started after only {sold_outs} sold-outs", t.sales - 1));
    }
    let taken = t.stocked - t.left;
    if taken != consumed_expected {
        problems.push(format!("stocked {} - left {} = {taken} != successes {consumed_expected}", t.stocked, t.left));
    }
    if t.streamed * QTY != taken {
        problems.push(format!("{} orders of {QTY} in the stream != {taken} units taken", t.streamed));
    }
    problems
}

#[cfg(test)]
mod tests {
    //! The invariants' arithmetic, without Redis (the scenario itself runs in
    //! tests/api/bench.rs).

    use super::{invariants, Tally, UNITS_PER_SALE};

    /// Two sales, the second half sold, every sale acknowledged and queued: no violation; a
    /// negative stock, a lost queue entry and a sale nobody was told of are each named.
    #[test]
    fn invariants_hold_for_a_clean_run_and_name_each_breach() {
        let half = UNITS_PER_SALE / 2;
        let clean = Tally { left: half, sales: 2, stocked: 2 * UNITS_PER_SALE, streamed: UNITS_PER_SALE + half };
        assert_eq!(invariants(&clean, UNITS_PER_SALE + half, 1), Vec::<String>::new());

        let oversold = Tally { left: -1, streamed: 2 * UNITS_PER_SALE + 1, ..clean };
        assert_eq!(invariants(&oversold, 2 * UNITS_PER_SALE + 1, 1).len(), 1, "negative stock");
        let lost = Tally { streamed: UNITS_PER_SALE + half - 1, ..clean };
        assert_eq!(invariants(&lost, UNITS_PER_SALE + half, 1).len(), 1, "one entry lost");
        assert_eq!(invariants(&clean, UNITS_PER_SALE + half - 1, 1).len(), 1, "one sale unacknowledged");
        assert_eq!(invariants(&clean, UNITS_PER_SALE + half, 0).len(), 1, "a sale started without a sold-out");
    }
}

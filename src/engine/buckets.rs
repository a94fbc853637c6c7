//! How a line takes from a bucketed resource: which buckets it tries in which order, and what
//! it takes from each. Pure rules, shared by the per-order path and batch admission.

/// The most buckets a resource may have.
pub const MAX_BUCKETS: i64 = 1024;

/// A stable seed for the default bucket order of one request (the same key tries the same
/// buckets first on every retry and in every process).
pub fn bucket_seed(tenant: &str, idempotency_key: &str) -> u64 {
    // FNV-1a: fixed across builds and processes, unlike the std hasher's keys.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in tenant.bytes().chain([0]).chain(idempotency_key.bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// The order in which a line tries a resource's `n` buckets: the plan's preferred buckets first
/// (duplicates ignored), then every other bucket in rotation from `seed`, so that no bucket is
/// ever left out. `Err` names a preferred bucket the resource does not have.
pub fn bucket_order(preferred: &[u16], n: i64, seed: u64) -> Result<Vec<i64>, String> {
    let n = n.clamp(1, MAX_BUCKETS);
    let mut seen = vec![false; n as usize];
    let mut order = Vec::with_capacity(n as usize);
    for &b in preferred {
        let b = i64::from(b);
        if b >= n {
            return Err(format!("the plan names bucket {b}, but the resource has {n} buckets"));
        }
        if !std::mem::replace(&mut seen[b as usize], true) {
            order.push(b);
        }
    }
    let start = (seed % n as u64) as i64;
    for i in 0..n {
        let b = (start + i) % n;
        if !seen[b as usize] {
            order.push(b);
        }
    }
    Ok(order)
}

/// What to take from which bucket for `qty`, trying buckets in `order` with `available[b]`: the
/// first bucket that covers it alone, else from each in order until covered (never refused
/// while the total covers it). `None`: the buckets together hold less than `qty`.
pub fn bucket_takes(order: &[i64], available: &[i64], qty: i64) -> Option<Vec<(i64, i64)>> {
    let have = |b: i64| available.get(b as usize).copied().unwrap_or(0);
    if let Some(&b) = order.iter().find(|&&b| have(b) >= qty) {
        return Some(vec![(b, qty)]);
    }
    let mut left = qty;
    let mut takes = Vec::new();
    for &b in order {
        let take = have(b).min(left);
        if take > 0 {
            takes.push((b, take));
            left -= take;
        }
        if left == 0 {
            return Some(takes);
        }
    }
    None
}

//! Where a webhook may be sent (SSRF): a tenant must not reach the operator's network. A URL is
//! `http` or `https`, at most [`MAX_URL_BYTES`], without credentials; its host must resolve to
//! at least one address outside loopback, private (RFC 1918), link-local, unique-local, CGNAT,
//! unspecified, multicast, documentation and reserved ranges (IPv4-mapped, -compatible, NAT64
//! and 6to4 IPv6 forms judged by the IPv4 address they carry). It is checked when the endpoint
//! is created, and again at every delivery by the HTTP client's resolver ([`GuardedResolver`]):
//! DNS may change, and the client connects only to the addresses the resolver vetted, so a
//! second lookup cannot slip another address in. `[events.webhooks] allow_private_targets`
//! turns the address check off (tests, private deployments).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use reqwest::Url;

/// Longest URL an endpoint may have.
pub const MAX_URL_BYTES: usize = 2048;

/// Why a URL is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    /// Malformed, wrong scheme, credentials, too long.
    #[error("{0}")]
    Invalid(String),
    /// Every address it resolves to is in a forbidden range.
    #[error("{0}")]
    Forbidden(String),
    /// It does not resolve (now).
    #[error("{0}")]
    Unresolvable(String),
}

/// Parses and checks the shape of an endpoint URL (no lookup).
pub fn parse_url(text: &str) -> Result<Url, TargetError> {
    let invalid = |why: &str| TargetError::Invalid(why.to_string());
    if text.len() > MAX_URL_BYTES {
        return Err(invalid("must be at most 2048 bytes"));
    }
    let url = Url::parse(text).map_err(|e| TargetError::Invalid(format!("not a URL ({e})")))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(invalid("must be an http or https URL"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(invalid("must not carry credentials"));
    }
    if url.fragment().is_some() {
        return Err(invalid("must not have a fragment"));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(invalid("must name a host"));
    }
    Ok(url)
}

/// The URL's host as an IP address, when it is one (`[::1]` included).
fn literal_ip(url: &Url) -> Option<IpAddr> {
    let host = url.host_str()?;
    host.trim_start_matches('[').trim_end_matches(']').parse().ok()
}

/// Resolves the URL's host and checks it may be a target: an IP literal must be allowed; a
/// name must resolve to at least one allowed address (the client uses only those).
pub async fn check(url: &Url, allow_private: bool, timeout: Duration) -> Result<(), TargetError> {
    if let Some(ip) = literal_ip(url) {
        return if allow_private || !is_forbidden(ip) {
            Ok(())
        } else {
            Err(TargetError::Forbidden(format!("{ip} is in a private, loopback or reserved range")))
        };
    }
    let host = url.host_str().unwrap_or_default().to_string();
    let port = url.port_or_known_default().unwrap_or(443);
    let addrs = match tokio::time::timeout(timeout, tokio::net::lookup_host((host.as_str(), port))).await {
        Ok(Ok(addrs)) => addrs.collect::<Vec<_>>(),
        Ok(Err(_)) | Err(_) => return Err(TargetError::Unresolvable(format!("{host} does not resolve"))),
    };
    if addrs.is_empty() {
        return Err(TargetError::Unresolvable(format!("{host} does not resolve")));
    }
    if allow_private || addrs.iter().any(|a| !is_forbidden(a.ip())) {
        Ok(())
    } else {
        Err(TargetError::Forbidden(format!("{host} resolves only to private, loopback or reserved addresses")))
    }
}

/// Checks an IP-literal URL at delivery time (the resolver is not asked for those).
pub fn literal_allowed(url: &Url, allow_private: bool) -> bool {
    allow_private || literal_ip(url).is_none_or(|ip| !is_forbidden(ip))
}

/// Whether a webhook must never be sent to this address.
pub fn is_forbidden(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => forbidden_v6(v6),
    }
}

fn forbidden_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    ip.is_unspecified()          // 0.0.0.0
        || a == 0                // 0.0.0.0/8 "this network"
        || ip.is_loopback()      // 127.0.0.0/8
        || ip.is_private()       // 10/8, 172.16/12, 192.168/16
        || ip.is_link_local()    // 169.254/16 (cloud metadata)
        || (a == 100 && (64..128).contains(&b)) // 100.64/10 CGNAT
        || (a == 192 && b == 0 && c == 0)       // 192.0.0/24 IETF protocol assignments
        || ip.is_documentation() // 192.0.2/24, 198.51.100/24, 203.0.113/24
        || (a == 198 && (b == 18 || b == 19))   // 198.18/15 benchmarking
        || ip.is_multicast()     // 224/4
        || a >= 240 // 240/4 reserved, 255.255.255.255 broadcast
}

fn forbidden_v6(ip: Ipv6Addr) -> bool {
    let segments = ip.segments();
    if let Some(v4) = ip.to_ipv4_mapped() {
        return forbidden_v4(v4); // ::ffff:a.b.c.d
    }
    let embedded = |hi: u16, lo: u16| Ipv4Addr::new((hi >> 8) as u8, hi as u8, (lo >> 8) as u8, lo as u8);
    if segments[..6] == [0, 0, 0, 0, 0, 0] {
        // ::a.b.c.d (deprecated IPv4-compatible); :: and ::1 fall in here too.
        return ip.is_unspecified() || ip.is_loopback() || forbidden_v4(embedded(segments[6], segments[7]));
    }
    if segments[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return forbidden_v4(embedded(segments[6], segments[7])); // NAT64
    }
    if segments[0] == 0x2002 {
        return forbidden_v4(embedded(segments[1], segments[2])); // 6to4
    }
    ip.is_multicast()                                  // ff00::/8
        || ip.is_unique_local()                        // fc00::/7
        || ip.is_unicast_link_local()                  // fe80::/10
        || (segments[0] & 0xffc0) == 0xfec0            // fec0::/10 site-local (deprecated)
        || (segments[0] == 0x2001 && segments[1] == 0x0db8) // 2001:db8::/32 documentation
        || (segments[0] == 0x2001 && segments[1] == 0)     // 2001::/32 Teredo
        || (segments[0] == 0x0100 && segments[1..4] == [0, 0, 0]) // 100::/64 discard
}

/// The error a refused lookup ends with; found again in the request's error chain.
#[derive(Debug, thiserror::Error)]
#[error("webhook target {0} resolves only to forbidden addresses")]
pub struct TargetRefused(pub String);

/// The HTTP client's resolver: resolves with the system, keeps only allowed addresses, fails
/// the request when none is left. The client connects to what this returns, so what was
/// checked is what is reached.
#[derive(Debug, Clone, Copy)]
pub struct GuardedResolver {
    pub allow_private: bool,
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let allow_private = self.allow_private;
        let host = name.as_str().to_string();
        Box::pin(async move {
            let found = tokio::net::lookup_host((host.as_str(), 0)).await?;
            let allowed: Vec<SocketAddr> = found.filter(|a| allow_private || !is_forbidden(a.ip())).collect();
            if allowed.is_empty() {
                return Err(Box::new(TargetRefused(host)) as Box<dyn std::error::Error + Send + Sync>);
            }
            Ok(Box::new(allowed.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn forbidden(text: &str) -> bool {
        is_forbidden(text.parse().unwrap())
    }

    #[test]
    fn operator_ranges_are_forbidden() {
        for ip in [
            "0.0.0.0",
            "0.1.2.3",
            "127.0.0.1",
            "127.255.0.9",
            "10.1.2.3",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "100.127.255.255",
            "192.0.0.8",
            "198.18.0.1",
            "224.0.0.1",
            "255.255.255.255",
            "240.0.0.1",
            "::",
            "::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "::ffff:169.254.169.254",
            "::127.0.0.1",
            "64:ff9b::10.0.0.1",
            "2002:c0a8:0101::1",
            "fc00::1",
            "fd12:3456::1",
            "fe80::1",
            "fec0::1",
            "ff02::1",
            "2001:db8::1",
            "2001::1",
        ] {
            assert!(forbidden(ip), "{ip} must be forbidden");
        }
    }

    #[test]
    fn public_addresses_are_allowed() {
        for ip in [
            "1.1.1.1",
            "8.8.8.8",
            "100.63.255.255",
            "100.128.0.1",
            "172.32.0.1",
            "2606:4700::1111",
            "::ffff:8.8.8.8",
            "64:ff9b::8.8.8.8",
            "2002:0808:0808::1",
        ] {
            assert!(!forbidden(ip), "{ip} must be allowed");
        }
    }

    #[test]
    fn urls_are_http_without_credentials_and_bounded() {
        assert!(parse_url("https://hooks.example.com/stockd?x=1").is_ok());
        assert!(parse_url("http://[::1]:8080/").is_ok());
        for bad in [
            "ftp://example.com/",
            "https://user:pw@example.com/",
            "https://example.com/#x",
            "not a url",
            "file:///etc/passwd",
        ] {
            assert!(matches!(parse_url(bad), Err(TargetError::Invalid(_))), "{bad}");
        }
        let long = format!("https://example.com/{}", "a".repeat(MAX_URL_BYTES));
        assert!(parse_url(&long).is_err());
    }

    #[tokio::test]
    async fn loopback_targets_are_refused_unless_allowed() {
        let timeout = Duration::from_secs(5);
        for url in ["http://127.0.0.1:9/", "http://[::1]:9/", "http://localhost:9/", "http://[::ffff:7f00:1]/"] {
            let url = parse_url(url).unwrap();
            assert!(matches!(check(&url, false, timeout).await, Err(TargetError::Forbidden(_))), "{url}");
            assert!(check(&url, true, timeout).await.is_ok(), "{url}");
            assert!(!literal_allowed(&url, false) || url.host_str() == Some("localhost"));
        }
    }
}

//! The statements the backends share (written once, in the `$n` form PostgreSQL and SQLite
//! read) as MySQL runs them: placeholders become `?` with their values bound in the order they
//! appear (a `$n` used twice is bound twice), and the column names MySQL reserves (`key`,
//! `lines`, `cursor`) are quoted. Only for the shared texts; this backend's own statements are
//! written for MySQL directly.

use sqlx::mysql::{MySql, MySqlArguments};
use sqlx::query::Query;

/// A value for a shared statement's `$n`.
#[derive(Debug, Clone, Copy)]
pub enum Arg<'a> {
    Int(i64),
    OptInt(Option<i64>),
    Text(&'a str),
    OptText(Option<&'a str>),
    Flag(bool),
}

/// Words MySQL reserves that are column names here.
const RESERVED: [&str; 3] = ["key", "lines", "cursor"];

/// `sql` in MySQL's form and, for each `?` in order, the index (from 0) of the `$n` it stands for.
pub fn translate(sql: &str) -> (String, Vec<usize>) {
    let bytes = sql.as_bytes();
    let mut out = String::with_capacity(sql.len() + 16);
    let mut order = Vec::new();
    let mut i = 0;
    let mut quoted = false;
    while i < bytes.len() {
        let c = bytes[i];
        if c == b'\'' {
            quoted = !quoted;
            out.push('\'');
            i += 1;
        } else if !quoted && c == b'$' && bytes.get(i + 1).is_some_and(u8::is_ascii_digit) {
            let start = i + 1;
            let mut end = start;
            while bytes.get(end).is_some_and(u8::is_ascii_digit) {
                end += 1;
            }
            let n: usize = sql[start..end].parse().unwrap_or(0);
            order.push(n.saturating_sub(1));
            out.push('?');
            i = end;
        } else if !quoted && (c.is_ascii_alphabetic() || c == b'_') {
            let start = i;
            while bytes.get(i).is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_') {
                i += 1;
            }
            let word = &sql[start..i];
            if RESERVED.iter().any(|r| r.eq_ignore_ascii_case(word)) {
                out.push('`');
                out.push_str(word);
                out.push('`');
            } else {
                out.push_str(word);
            }
        } else {
            // Multi-byte characters are copied whole (only ASCII is ever matched above).
            let ch = sql[i..].chars().next().unwrap_or(' ');
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    // MySQL's integer cast target.
    (out.replace(" AS BIGINT)", " AS SIGNED)"), order)
}

/// A shared statement with its values bound in MySQL's order. `translated` comes from
/// [`translate`] (kept by the caller, as the query borrows it).
pub fn bind_all<'q>(translated: &'q (String, Vec<usize>), args: &[Arg<'q>]) -> Query<'q, MySql, MySqlArguments> {
    let mut query = sqlx::query(&translated.0);
    for &n in &translated.1 {
        query = match args.get(n).copied().unwrap_or(Arg::OptText(None)) {
            Arg::Int(v) => query.bind(v),
            Arg::OptInt(v) => query.bind(v),
            Arg::Text(v) => query.bind(v),
            Arg::OptText(v) => query.bind(v),
            Arg::Flag(v) => query.bind(v),
        };
    }
    query
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_bound_in_order_of_appearance_and_reserved_names_quoted() {
        let (sql, order) = translate(
            "SELECT used FROM user_limits WHERE tenant_id = $1 AND key = $2 OR (tenant_id = $1 AND 'key' = $3)",
        );
        assert_eq!(
            sql,
            "SELECT used FROM user_limits WHERE tenant_id = ? AND `key` = ? OR (tenant_id = ? AND 'key' = ?)"
        );
        assert_eq!(order, vec![0, 1, 0, 2]);
        assert_eq!(translate("SELECT r.key, lines, keys FROM x").0, "SELECT r.`key`, `lines`, keys FROM x");
    }
}

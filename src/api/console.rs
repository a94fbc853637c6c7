//! The browser console at `/console`: one page, a script and a stylesheet, compiled into the
//! binary, that sign in with a tenant API key or the admin token and speak only the public REST
//! API (docs/CONSOLE.md). No asset comes from anywhere else, so it works without internet access,
//! and the Content-Security-Policy says so to the browser.

use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::HeaderName;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;

use super::SharedState;

const INDEX_HTML: &str = include_str!("console/index.html");
const CONSOLE_JS: &str = include_str!("console/console.js");
const CONSOLE_CSS: &str = include_str!("console/console.css");

/// Scripts, styles and requests from this origin only; no frames, no plugins, no inline script.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                   connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'";

pub fn routes() -> Router<SharedState> {
    Router::new()
        .route("/console", get(|| async { Redirect::permanent("/console/") }))
        .route("/console/", get(|| async { asset("text/html; charset=utf-8", INDEX_HTML) }))
        .route("/console/console.js", get(|| async { asset("text/javascript; charset=utf-8", CONSOLE_JS) }))
        .route("/console/console.css", get(|| async { asset("text/css; charset=utf-8", CONSOLE_CSS) }))
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (CONTENT_TYPE, content_type),
            // The assets change with the binary: revalidate rather than run an old script
            // against a newer server.
            (CACHE_CONTROL, "no-cache"),
            (HeaderName::from_static("content-security-policy"), CSP),
            (HeaderName::from_static("x-content-type-options"), "nosniff"),
            (HeaderName::from_static("referrer-policy"), "no-referrer"),
        ],
        body,
    )
        .into_response()
}

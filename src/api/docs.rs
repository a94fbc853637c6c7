//! The OpenAPI 3 document (`GET /openapi.json`): generated from the handlers' annotations, with
//! the answers whole classes of operations share added here once (authentication, rate limit,
//! validation, body size and type, load shedding), so a new route cannot miss them, and the
//! bounds that depend on the server's settings filled in per process.

use utoipa::openapi::header::Header;
use utoipa::openapi::path::{Operation, ParameterIn};
use utoipa::openapi::schema::{ObjectBuilder, Ref, Schema, SchemaType, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{Content, RefOr, ResponseBuilder};
use utoipa::{Modify, OpenApi};

use super::error::PROBLEM_JSON;
use super::extract::MAX_PAGE;
use super::{admin, events, ops, orders, plugins, reservations, resources, warm, webhooks, ApiSettings};
use crate::events::EventType;

#[derive(OpenApi)]
#[openapi(
    info(title = "stockd", description = "Deducts consumable resources exactly once under concurrency, retries and crashes."),
    paths(
        ops::healthz, ops::readyz, ops::metrics_text, ops::openapi,
        admin::create_tenant, admin::list_tenants, admin::create_api_key, admin::list_api_keys, admin::revoke_api_key,
        admin::set_rate_limit, admin::clear_rate_limit,
        resources::create_resource, resources::get_resource, resources::list_resources, resources::patch_resource,
        resources::adjust, resources::ledger, warm::warm,
        orders::create_order, orders::dry_run, orders::get_order, orders::reverse_order,
        reservations::list_held, reservations::get_reservation, reservations::confirm, reservations::release, reservations::reconciliation,
        plugins::put_plugin, plugins::get_plugin, plugins::list_versions, plugins::activate, plugins::upload_status,
        events::events,
        webhooks::create_webhook, webhooks::list_webhooks, webhooks::get_webhook, webhooks::delete_webhook,
        webhooks::rotate_secret, webhooks::list_deliveries, webhooks::redeliver,
    ),
    components(schemas(crate::problem::Problem)),
    modifiers(&Security, &CommonAnswers, &Bounds),
    tags(
        (name = "orders", description = "Deduct or reserve several lines at once"),
        (name = "resources", description = "Consumable counters and their ledgers"),
        (name = "reservations", description = "Held stock: confirm, release, expiry"),
        (name = "webhooks", description = "Signed delivery of the tenant's events to its HTTP endpoints"),
        (name = "plugins", description = "The tenant's planning plugin (WebAssembly component)"),
        (name = "admin", description = "Tenants and API keys (admin token)"),
        (name = "events", description = "The tenant's event feed (transactional outbox)"),
    )
)]
pub struct ApiDoc;

struct Security;

impl Modify for Security {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        let bearer = || SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build());
        components.add_security_scheme("api_key", bearer());
        components.add_security_scheme("admin_token", bearer());
    }
}

/// What a problem answer of one class says, and the headers it carries.
struct Answer {
    status: &'static str,
    description: &'static str,
    retry_after: bool,
    rate_limit: bool,
}

/// A problem answer without headers.
const fn problem(status: &'static str, description: &'static str) -> Answer {
    Answer { status, description, retry_after: false, rate_limit: false }
}

const UNAUTHORIZED: Answer = problem("401", "unauthorized: the bearer token is missing, unknown or revoked");
const FORBIDDEN: Answer = problem("403", "forbidden: a tenant key on an admin route");
const RATE_LIMITED: Answer = Answer {
    retry_after: true,
    rate_limit: true,
    ..problem("429", "rate_limited: the tenant's token bucket is empty; nothing was applied or stored")
};
const UNAVAILABLE: Answer = Answer {
    retry_after: true,
    rate_limit: false,
    ..problem(
        "503",
        "unavailable: storage unreachable, the request past its time limit, or the server at its \
                  limit of requests in flight; nothing was applied, retry after Retry-After",
    )
};
const INVALID: Answer =
    problem("400", "validation_failed: a malformed or out-of-range parameter or body; `detail` names it");
const TOO_LARGE: Answer = problem("413", "payload_too_large: the body is over the configured limit");
const WRONG_TYPE: Answer = problem("415", "unsupported_media_type: the body is not of the documented content type");

/// Routes that are never shed and answer without storage: they cannot answer `503`.
const NEVER_UNAVAILABLE: [&str; 2] = ["/healthz", "/metrics"];

/// The security scheme an operation requires, if any.
fn scheme(operation: &Operation) -> Option<&'static str> {
    let named = |name: &str| {
        operation.security.iter().flatten().any(|s| serde_json::to_value(s).is_ok_and(|v| v.get(name).is_some()))
    };
    ["api_key", "admin_token"].into_iter().find(|name| named(name))
}

/// The answers every operation of a class can give, added to each: `401` to every secured
/// operation, `403` to admin ones, `429 rate_limited` to tenant ones, `503` to every one that
/// can be shed or reaches storage, `400` to every one that reads a parameter or a body, `413` and
/// `415` to every one that reads a body. A handler's own description of the same status (a
/// `429 too_many_requests`, a `503 redis_not_warmed`) is kept beside the common one.
struct CommonAnswers;

impl Modify for CommonAnswers {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for (path, item) in openapi.paths.paths.iter_mut() {
            let operations = [&mut item.get, &mut item.put, &mut item.post, &mut item.delete, &mut item.patch];
            for operation in operations.into_iter().flatten() {
                let mut answers = Vec::new();
                match scheme(operation) {
                    Some("api_key") => answers.extend([&UNAUTHORIZED, &RATE_LIMITED]),
                    Some(_) => answers.extend([&UNAUTHORIZED, &FORBIDDEN]),
                    None => {}
                }
                if !NEVER_UNAVAILABLE.contains(&path.as_str()) {
                    answers.push(&UNAVAILABLE);
                }
                if operation.parameters.as_ref().is_some_and(|p| !p.is_empty()) || operation.request_body.is_some() {
                    answers.push(&INVALID);
                }
                if operation.request_body.is_some() {
                    answers.extend([&TOO_LARGE, &WRONG_TYPE]);
                }
                for answer in answers {
                    add(operation, answer);
                }
            }
        }
    }
}

fn add(operation: &mut Operation, answer: &Answer) {
    let header = |schema_type: Type, description: &str| {
        Header::builder().schema(ObjectBuilder::new().schema_type(schema_type)).description(Some(description)).build()
    };
    let own = match operation.responses.responses.get(answer.status) {
        Some(RefOr::T(response)) if !response.description.is_empty() => Some(response.description.clone()),
        _ => None,
    };
    let description = match own {
        Some(own) if own != answer.description => format!("{}; or {own}", answer.description),
        _ => answer.description.to_string(),
    };
    let mut response = ResponseBuilder::new()
        .description(description)
        .content(PROBLEM_JSON, Content::new(Some(Ref::from_schema_name("Problem"))));
    if answer.retry_after {
        response =
            response.header("Retry-After", header(Type::Integer, "whole seconds to wait before retrying (at least 1)"));
    }
    if answer.rate_limit {
        response = response
            .header("RateLimit-Policy", header(Type::String, "the bucket: `\"tenant\";q=<burst>;w=<seconds to fill>`"))
            .header("RateLimit", header(Type::String, "`\"tenant\";r=0;t=<Retry-After>`"));
    }
    operation.responses.responses.insert(answer.status.into(), RefOr::T(response.build()));
}

/// The bounds of parameters that the server derives from its constants: every `limit` is
/// 1..=[`MAX_PAGE`], and the feed's `types` is a comma-separated list of known event types.
struct Bounds;

impl Modify for Bounds {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let names: Vec<String> = EventType::ALL.iter().map(|t| regex_escape(t.as_str())).collect();
        // The server trims blanks around each name; an empty list means every type.
        let one = format!("\\s*({})\\s*", names.join("|"));
        let types = format!("^({one}(,{one})*)?$");
        for item in openapi.paths.paths.values_mut() {
            let operations = [&mut item.get, &mut item.put, &mut item.post, &mut item.delete, &mut item.patch];
            for operation in operations.into_iter().flatten() {
                not_null_queries(operation);
                if let Some(limit) = query_schema(operation, "limit") {
                    limit.minimum = Some(1.into());
                    limit.maximum = Some(MAX_PAGE.into());
                }
                if let Some(schema) = query_schema(operation, "types") {
                    schema.pattern = Some(types.clone());
                }
            }
        }
    }
}

/// A query parameter is absent or has a value; it is never `null` (the generated schema of an
/// `Option` says it may be).
fn not_null_queries(operation: &mut Operation) {
    let queries = operation.parameters.iter_mut().flatten().filter(|p| matches!(p.parameter_in, ParameterIn::Query));
    for parameter in queries {
        let schema = match parameter.schema.take() {
            Some(RefOr::T(Schema::Object(mut object))) => {
                if let SchemaType::Array(types) = &object.schema_type {
                    let types: Vec<Type> = types.iter().filter(|t| **t != Type::Null).cloned().collect();
                    if let [one] = types.as_slice() {
                        object.schema_type = SchemaType::Type(one.clone());
                    }
                }
                RefOr::T(Schema::Object(object))
            }
            Some(RefOr::T(Schema::OneOf(one_of))) => {
                let mut items: Vec<RefOr<Schema>> = one_of.items.iter().filter(|i| !is_null(i)).cloned().collect();
                match items.len() {
                    1 => items.remove(0),
                    _ => RefOr::T(Schema::OneOf(one_of)),
                }
            }
            Some(other) => other,
            None => continue,
        };
        parameter.schema = Some(schema);
    }
}

fn is_null(schema: &RefOr<Schema>) -> bool {
    matches!(schema, RefOr::T(Schema::Object(o)) if o.schema_type == SchemaType::Type(Type::Null))
}

fn regex_escape(text: &str) -> String {
    text.replace('.', "\\.")
}

/// The schema of a query parameter, to fill in its bounds.
fn query_schema<'a>(operation: &'a mut Operation, name: &str) -> Option<&'a mut utoipa::openapi::schema::Object> {
    let parameter = operation
        .parameters
        .iter_mut()
        .flatten()
        .find(|p| p.name == name && matches!(p.parameter_in, ParameterIn::Query))?;
    match parameter.schema.as_mut()? {
        RefOr::T(Schema::Object(object)) => Some(object),
        _ => None,
    }
}

/// The document this server answers: [`ApiDoc`] with the bounds its settings decide (the
/// longest `wait` of `GET /v1/events`).
pub fn document(settings: &ApiSettings) -> utoipa::openapi::OpenApi {
    let mut openapi = ApiDoc::openapi();
    let events = openapi.paths.paths.get_mut("/v1/events").and_then(|item| item.get.as_mut());
    if let Some(wait) = events.and_then(|operation| query_schema(operation, "wait")) {
        wait.minimum = Some(0.into());
        wait.maximum = Some(events::max_wait(settings).as_secs().into());
    }
    openapi
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::Value;

    use super::*;

    /// Error answers that are not problem documents: a rejected order's `409` is the order
    /// document, and `/metrics` without a recorder answers a plain-text `404`.
    const NOT_PROBLEMS: [(&str, &str, &str); 2] = [("post", "/v1/orders", "409"), ("get", "/metrics", "404")];

    fn settings() -> ApiSettings {
        ApiSettings {
            body_limit_bytes: 1 << 20,
            request_timeout: Duration::from_secs(30),
            max_in_flight: 1,
            max_plugin_versions: 1,
            upload_wait: Duration::from_secs(1),
            events: crate::config::EventsConfig::default(),
        }
    }

    fn operations(doc: &Value) -> Vec<(String, String, Value)> {
        let mut found = Vec::new();
        for (path, item) in doc["paths"].as_object().into_iter().flatten() {
            for (method, operation) in item.as_object().into_iter().flatten() {
                found.push((method.clone(), path.clone(), operation.clone()));
            }
        }
        found
    }

    /// The statuses an operation's shape says it can answer, decided from the document alone.
    fn required(path: &str, operation: &Value) -> Vec<&'static str> {
        let schemes: Vec<&str> = operation["security"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_object)
            .flat_map(|s| s.keys().map(String::as_str))
            .collect();
        let mut statuses = Vec::new();
        if schemes.contains(&"api_key") {
            statuses.extend(["401", "429"]);
        }
        if schemes.contains(&"admin_token") {
            statuses.extend(["401", "403"]);
        }
        if !["/healthz", "/metrics"].contains(&path) {
            statuses.push("503");
        }
        let body = operation.get("requestBody").is_some();
        if body || operation["parameters"].as_array().is_some_and(|p| !p.is_empty()) {
            statuses.push("400");
        }
        if body {
            statuses.extend(["413", "415"]);
        }
        if path.contains('{') {
            statuses.push("404");
        }
        statuses
    }

    /// Every operation documents each status its class of operation can answer (a new route
    /// cannot miss one), and every error answer is a problem document.
    #[test]
    fn every_operation_documents_the_answers_its_class_can_give() {
        let doc = serde_json::to_value(document(&settings())).unwrap_or_default();
        let operations = operations(&doc);
        assert!(operations.len() >= 37, "the document lists {} operations", operations.len());
        let mut missing = Vec::new();
        for (method, path, operation) in &operations {
            let responses = &operation["responses"];
            for status in required(path, operation) {
                if responses.get(status).is_none() {
                    missing.push(format!("{method} {path}: {status}"));
                }
            }
            for (status, response) in responses.as_object().into_iter().flatten() {
                let error = status.starts_with('4') || status.starts_with('5');
                if !error || NOT_PROBLEMS.contains(&(method.as_str(), path.as_str(), status.as_str())) {
                    continue;
                }
                let schema = &response["content"][PROBLEM_JSON]["schema"]["$ref"];
                if schema != "#/components/schemas/Problem" {
                    missing.push(format!("{method} {path}: {status} is not a problem+json Problem"));
                }
            }
        }
        assert!(missing.is_empty(), "undocumented answers:\n{}", missing.join("\n"));
    }

    /// Every paged list documents the page bounds the server enforces, and the feed's `wait`
    /// the longest wait this server allows.
    #[test]
    fn query_parameters_carry_the_bounds_the_server_enforces() {
        let doc = serde_json::to_value(document(&settings())).unwrap_or_default();
        let mut limits = 0;
        for (method, path, operation) in operations(&doc) {
            for parameter in operation["parameters"].as_array().into_iter().flatten() {
                if parameter["name"] == "limit" {
                    limits += 1;
                    let schema = &parameter["schema"];
                    assert_eq!(
                        (&schema["minimum"], &schema["maximum"]),
                        (&Value::from(1), &Value::from(MAX_PAGE)),
                        "{method} {path}"
                    );
                }
            }
        }
        assert_eq!(limits, 5, "resources, ledger, events, deliveries, held reservations");
        let wait = doc["paths"]["/v1/events"]["get"]["parameters"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["name"] == "wait")
            .map(|p| p["schema"]["maximum"].clone());
        assert_eq!(wait, Some(Value::from(25)), "[events] max_wait_seconds by default");
    }
}

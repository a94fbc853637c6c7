//! The OpenAPI 3 document, generated from the handlers' annotations (`GET /openapi.json`).

use utoipa::openapi::header::Header;
use utoipa::openapi::schema::{ObjectBuilder, Ref, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{Content, ResponseBuilder};
use utoipa::{Modify, OpenApi};

use super::{admin, events, ops, orders, plugins, reservations, resources, warm, webhooks};

#[derive(OpenApi)]
#[openapi(
    info(title = "stockd", description = "Deducts consumable resources exactly once under concurrency, retries and crashes."),
    paths(
        ops::healthz, ops::readyz, ops::metrics_text, ops::openapi,
        admin::create_tenant, admin::list_tenants, admin::create_api_key, admin::revoke_api_key,
        admin::set_rate_limit, admin::clear_rate_limit,
        resources::create_resource, resources::get_resource, resources::list_resources, resources::patch_resource,
        resources::adjust, resources::ledger, warm::warm,
        orders::create_order, orders::dry_run, orders::get_order, orders::reverse_order,
        reservations::list_held, reservations::get_reservation, reservations::confirm, reservations::release, reservations::reconciliation,
        plugins::put_plugin, plugins::get_plugin, plugins::list_versions, plugins::activate,
        events::events,
        webhooks::create_webhook, webhooks::list_webhooks, webhooks::get_webhook, webhooks::delete_webhook,
        webhooks::rotate_secret, webhooks::list_deliveries, webhooks::redeliver,
    ),
    components(schemas(crate::problem::Problem)),
    modifiers(&Security, &RateLimited),
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

/// Every tenant operation (secured by `api_key`) may answer `429 rate_limited`: added here
/// once rather than on each handler, so a new tenant route cannot miss it.
struct RateLimited;

impl Modify for RateLimited {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let header = |schema_type: Type, description: &str| {
            Header::builder()
                .schema(ObjectBuilder::new().schema_type(schema_type))
                .description(Some(description))
                .build()
        };
        let response = ResponseBuilder::new()
            .description("rate_limited: the tenant's token bucket is empty; nothing was applied or stored")
            .header("Retry-After", header(Type::Integer, "whole seconds until a token is back (at least 1)"))
            .header("RateLimit-Policy", header(Type::String, "the bucket: `\"tenant\";q=<burst>;w=<seconds to fill>`"))
            .header("RateLimit", header(Type::String, "`\"tenant\";r=0;t=<Retry-After>`"))
            .content("application/problem+json", Content::new(Some(Ref::from_schema_name("Problem"))))
            .build();
        for item in openapi.paths.paths.values_mut() {
            let operations = [&mut item.get, &mut item.put, &mut item.post, &mut item.delete, &mut item.patch];
            for operation in operations.into_iter().flatten() {
                let by_tenant = operation
                    .security
                    .iter()
                    .flatten()
                    .any(|s| serde_json::to_value(s).is_ok_and(|v| v.get("api_key").is_some()));
                if by_tenant {
                    operation.responses.responses.insert("429".into(), response.clone().into());
                }
            }
        }
    }
}

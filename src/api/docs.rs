//! The OpenAPI 3 document, generated from the handlers' annotations (`GET /openapi.json`).

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::{admin, hot, ops, orders, plugins, reservations, resources};

#[derive(OpenApi)]
#[openapi(
    info(title = "stockd", description = "Deducts consumable resources exactly once under concurrency, retries and crashes."),
    paths(
        ops::healthz, ops::readyz, ops::metrics_text, ops::openapi,
        admin::create_tenant, admin::list_tenants, admin::create_api_key, admin::revoke_api_key,
        resources::create_resource, resources::get_resource, resources::list_resources, resources::patch_resource,
        resources::adjust, resources::ledger, hot::warm,
        orders::create_order, orders::dry_run,
        reservations::get_reservation, reservations::confirm, reservations::release, reservations::reconciliation,
        plugins::put_plugin, plugins::get_plugin, plugins::list_versions, plugins::activate,
    ),
    components(schemas(crate::problem::Problem)),
    modifiers(&Security),
    tags(
        (name = "orders", description = "Deduct or reserve several lines at once"),
        (name = "resources", description = "Consumable counters and their ledgers"),
        (name = "reservations", description = "Held stock: confirm, release, expiry"),
        (name = "plugins", description = "The tenant's planning plugin (WebAssembly component)"),
        (name = "admin", description = "Tenants and API keys (admin token)"),
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

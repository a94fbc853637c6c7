//! `stockd plugin new` end to end: the real binary writes a crate into a temporary folder, which
//! builds into a component with nothing but the files it wrote (and crates.io), passes
//! `stockd plugin check --cases cases.toml` as it is, uploads to a real server and plans its
//! orders. Also what `plugin new` refuses: bad names, folders that are not empty, a `--sdk`
//! that is not the SDK.
//!
//! The one build (wit-bindgen for wasm32-wasip2 in release mode) uses
//! `${CARGO_TARGET_DIR:-$HOME/.cache/stockd-target}/plugin-new`, so reruns are warm.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

use serde_json::{json, Value};

use crate::helpers::spawn_app;

/// The crate every test here creates.
const NAME: &str = "my-planner";

/// Runs the stockd binary with `args` in `dir`.
fn stockd(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stockd"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run stockd {args:?}: {e}"))
}

/// Stdout and stderr of a finished command, for assertion messages.
fn printed(output: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}--- stderr\n{}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// A file of the stockd repository.
fn repo_file(path: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A file of a created crate.
fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Adds the wasm32-wasip2 target through rustup when it is missing, as `plugins/build.sh` does.
fn ensure_wasm_target() {
    let Ok(installed) = Command::new("rustup").args(["target", "list", "--installed"]).output() else {
        return; // no rustup: the toolchain must already have the target, or the build says so
    };
    if !String::from_utf8_lossy(&installed.stdout).lines().any(|line| line == "wasm32-wasip2") {
        let added = Command::new("rustup").args(["target", "add", "wasm32-wasip2"]).output();
        assert!(added.as_ref().is_ok_and(|o| o.status.success()), "rustup target add wasm32-wasip2: {added:?}");
    }
}

/// Builds the crate in `dir` into a component, exactly as its README says plus `--locked` (the
/// written Cargo.lock must be complete), and returns the component's path.
fn build_component(dir: &Path) -> PathBuf {
    ensure_wasm_target();
    let root = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache").join("stockd-target")
    });
    let target_dir = root.join("plugin-new");
    let started = Instant::now();
    let output = Command::new("cargo")
        .args(["build", "--release", "--locked", "--target", "wasm32-wasip2"])
        .env("CARGO_TARGET_DIR", &target_dir)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run cargo: {e}"));
    assert!(output.status.success(), "the new crate builds as it is: {}", printed(&output));
    println!("cargo build --release --target wasm32-wasip2: {:.1} s", started.elapsed().as_secs_f64());
    target_dir.join("wasm32-wasip2").join("release").join(format!("{}.wasm", NAME.replace('-', "_")))
}

/// Proves a new plugin works from one command to a planned order: `plugin new` inside another
/// Cargo workspace writes the SDK and WIT byte for byte as the repository has them; the crate
/// builds with its own lock file; `plugin check --cases cases.toml` passes as written (and
/// fails on a changed expectation); uploaded to a server, it plans a two-line order as the
/// cases say (dry-run shows the plan, the order applies), and its inventory-only rule, which
/// the built-in default does not have, rejects a line on a balance.
#[tokio::test]
async fn a_new_plugin_builds_passes_its_cases_and_plans_orders_on_a_server() {
    let workspace = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    // An enclosing workspace that does not list the plugin: without its own [workspace], cargo
    // would refuse to build the new crate here.
    std::fs::write(workspace.path().join("Cargo.toml"), "[workspace]\nmembers = []\n")
        .unwrap_or_else(|e| panic!("{e}"));
    let created = stockd(workspace.path(), &["plugin", "new", NAME]);
    assert!(created.status.success(), "{}", printed(&created));
    assert!(
        String::from_utf8_lossy(&created.stdout).contains("Created plugin crate `my-planner`"),
        "{}",
        printed(&created)
    );

    let dir = workspace.path().join(NAME);
    for (written, original) in [
        ("vendor/stockd-plugin-sdk/Cargo.toml", "plugins/sdk/Cargo.toml"),
        ("vendor/stockd-plugin-sdk/src/lib.rs", "plugins/sdk/src/lib.rs"),
        ("wit/stockd-plugin.wit", "wit/stockd-plugin.wit"),
    ] {
        assert_eq!(read(&dir.join(written)), repo_file(original), "{written} is the repository's {original}");
    }
    let manifest = read(&dir.join("Cargo.toml"));
    assert!(manifest.contains("stockd-plugin-sdk = { path = \"vendor/stockd-plugin-sdk\" }"), "{manifest}");
    assert!(manifest.contains("\n[workspace]\n") && manifest.contains("\n[profile.release]\n"), "{manifest}");
    for file in ["Cargo.lock", "src/lib.rs", "cases.toml", "README.md", ".gitignore"] {
        assert!(dir.join(file).is_file(), "{file} is written");
    }
    let readme = read(&dir.join("README.md"));
    assert!(readme.contains("stockd plugin check target/wasm32-wasip2/release/my_planner.wasm --cases cases.toml"));

    let wasm_path = build_component(&dir);
    let wasm_arg = wasm_path.to_str().unwrap_or_else(|| panic!("{} is not UTF-8", wasm_path.display()));
    let checked = stockd(&dir, &["plugin", "check", wasm_arg, "--cases", "cases.toml"]);
    assert!(checked.status.success(), "the cases pass as written: {}", printed(&checked));
    let report = String::from_utf8_lossy(&checked.stdout);
    assert!(report.contains("2 orders: 0 failed; 2 with expectations, 0 not met"), "{report}");

    let changed = read(&dir.join("cases.toml")).replace("policy = \"all_or_nothing\"", "policy = \"allow_partial\"");
    std::fs::write(dir.join("changed.toml"), changed).unwrap_or_else(|e| panic!("{e}"));
    let mismatch = stockd(&dir, &["plugin", "check", wasm_arg, "--cases", "changed.toml"]);
    assert_eq!(mismatch.status.code(), Some(1), "{}", printed(&mismatch));
    assert!(
        String::from_utf8_lossy(&mismatch.stdout)
            .contains("expect: MISMATCH: plan.policy: expected \"allow_partial\", the plan has \"all_or_nothing\""),
        "{}",
        printed(&mismatch)
    );
    assert!(String::from_utf8_lossy(&mismatch.stderr).contains("1 of 2 orders did not plan as expected"));

    let app = spawn_app().await;
    let shop = app.create_tenant("shop").await;
    shop.create_resource("sku-1", 10).await;
    shop.create_resource("sku-2", 10).await;
    shop.create_resource_of_kind("wallet-1", "balance", 100).await;
    let wasm = std::fs::read(&wasm_path).unwrap_or_else(|e| panic!("{}: {e}", wasm_path.display()));
    let uploaded = shop.put_plugin(wasm).await.expect_json(201);
    assert_eq!(uploaded["version"], 1, "{uploaded}");
    assert_eq!(uploaded["active"], true, "{uploaded}");

    // The first order of cases.toml, as a client sends it.
    let order = json!({"order_id": "two-skus", "user_id": "u-42", "action": "deduct", "lines": [
        {"key": "sku-1", "qty": 2, "attributes": {"warehouse": "east"}}, {"key": "sku-2", "qty": 1}]});
    let target =
        |resource: &str| json!({"resource": resource, "kind": "inventory", "create_if_missing": null, "buckets": []});
    let dry = shop.post("/v1/orders/dry-run", &order).await.expect_json(200);
    assert_eq!(dry["plan"]["policy"], "all_or_nothing", "{dry}");
    let planned: Vec<(Value, Value, Value)> = dry["plan"]["lines"]
        .as_array()
        .map(|lines| lines.iter().map(|l| (l["line"].clone(), l["qty"].clone(), l["targets"].clone())).collect())
        .unwrap_or_default();
    assert_eq!(
        planned,
        [(json!(0), json!(2), json!([target("sku-1")])), (json!(1), json!(1), json!([target("sku-2")]))],
        "{dry}"
    );
    assert_eq!(dry["outcome"]["status"], "succeeded", "{dry}");

    let doc = shop.order("idem-two-skus", &order).await.expect_json(201);
    assert_eq!(doc["status"], "succeeded", "{doc}");
    assert_eq!(doc["plugin"], json!({"name": "wasm", "version": 1}), "{doc}");
    let applied: Vec<(Value, Value)> = doc["lines"]
        .as_array()
        .map(|lines| lines.iter().map(|l| (l["resource"].clone(), l["applied"].clone())).collect())
        .unwrap_or_default();
    assert_eq!(applied, [(json!("sku-1"), json!(2)), (json!("sku-2"), json!(1))], "{doc}");
    assert_eq!(shop.state("sku-1").await["available"], 8);
    assert_eq!(shop.state("sku-2").await["available"], 9);

    // The template insists on inventory: a line on a balance does not apply, all-or-nothing.
    let on_balance = json!({"order_id": "wallet", "action": "deduct", "lines": [
        {"key": "sku-1", "qty": 1}, {"key": "wallet-1", "qty": 5}]});
    let doc = shop.order("idem-wallet", &on_balance).await.expect_json(409);
    assert_eq!(doc["status"], "rejected", "{doc}");
    assert_eq!(doc["lines"][1]["reason"], "resource_not_found", "{doc}");
    assert_eq!(shop.state("wallet-1").await["available"], 100);
    assert_eq!(shop.state("sku-1").await["available"], 8);
}

/// Proves what `plugin new` refuses, each with exit code 1, a message saying why and nothing
/// written: names cargo would refuse, a folder that exists and is not empty (left as it was),
/// a `--sdk` that is not the SDK. An empty folder given by `--path` is used, and `--sdk` with
/// a stockd checkout uses its plugins/sdk by absolute path, with no copy of the SDK or WIT.
#[test]
fn plugin_new_refuses_bad_names_occupied_folders_and_wrong_sdks() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let here = tmp.path();
    let refused = |args: &[&str], why: &str| {
        let output = stockd(here, args);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {}", printed(&output));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(why), "{args:?} is refused saying {why:?}: {}", printed(&output));
    };
    refused(&["plugin", "new", "1st"], "starts with '1'");
    refused(&["plugin", "new", "my planner"], "contains ' '");
    refused(&["plugin", "new", "fn"], "reserved by Rust or Cargo");
    refused(&["plugin", "new", "wit-bindgen"], "a crate the plugin SDK depends on");
    let nothing: Vec<_> =
        std::fs::read_dir(here).map(|d| d.flatten().map(|e| e.file_name()).collect()).unwrap_or_default();
    assert!(nothing.is_empty(), "nothing is written for a refused name: {nothing:?}");

    std::fs::create_dir(here.join("taken")).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(here.join("taken").join("notes.txt"), "mine").unwrap_or_else(|e| panic!("{e}"));
    refused(&["plugin", "new", NAME, "--path", "taken"], "taken already exists and is not empty");
    assert_eq!(read(&here.join("taken").join("notes.txt")), "mine");
    assert_eq!(std::fs::read_dir(here.join("taken")).map(Iterator::count).unwrap_or_default(), 1);
    std::fs::write(here.join("file"), "").unwrap_or_else(|e| panic!("{e}"));
    refused(&["plugin", "new", NAME, "--path", "file"], "file already exists and is not a folder");
    refused(&["plugin", "new", NAME, "--sdk", "."], "neither it nor its plugins/sdk holds the stockd-plugin-sdk crate");

    std::fs::create_dir(here.join("empty")).unwrap_or_else(|e| panic!("{e}"));
    let repo = env!("CARGO_MANIFEST_DIR");
    let created = stockd(here, &["plugin", "new", NAME, "--path", "empty", "--sdk", repo]);
    assert!(created.status.success(), "{}", printed(&created));
    let manifest = read(&here.join("empty").join("Cargo.toml"));
    let sdk = std::fs::canonicalize(Path::new(repo).join("plugins").join("sdk")).unwrap_or_else(|e| panic!("{e}"));
    assert!(manifest.contains(&format!("stockd-plugin-sdk = {{ path = \"{}\" }}", sdk.display())), "{manifest}");
    assert!(manifest.contains("name = \"my-planner\""), "{manifest}");
    assert!(!here.join("empty").join("vendor").exists() && !here.join("empty").join("wit").exists());
    let leftovers: Vec<_> = std::fs::read_dir(here)
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    assert!(!leftovers.iter().any(|name| name.starts_with(".stockd-plugin-new-")), "{leftovers:?}");

    let usage = stockd(here, &["plugin", "new"]);
    assert_eq!(usage.status.code(), Some(2), "a missing NAME is a usage error: {}", printed(&usage));
}

/// Where `plugins/build-components.sh --tools` installed the pinned tools: the folder of
/// componentize-js (and jco), and the folder of componentize-py.
fn component_tools() -> (PathBuf, PathBuf) {
    let output = Command::new("bash")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/plugins/build-components.sh"))
        .arg("--tools")
        .output()
        .unwrap_or_else(|e| panic!("cannot run plugins/build-components.sh: {e}"));
    assert!(output.status.success(), "{}", printed(&output));
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    let mut lines = text.lines().map(PathBuf::from);
    match (lines.next(), lines.next()) {
        (Some(node), Some(python)) => (node, python),
        _ => panic!("build-components.sh --tools printed {text:?}"),
    }
}

/// Runs `program` with `args` in `dir`; asserts it succeeds.
fn run_in(dir: &Path, program: &Path, args: &[&str]) {
    let output = Command::new(program)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()));
    assert!(output.status.success(), "{} {args:?}: {}", program.display(), printed(&output));
}

/// `stockd plugin check FILE --runtime RUNTIME --cases cases.toml` in `dir`, keeping compiled
/// plugins where the suite's servers keep them; asserts every case passed as written.
fn check_passes(dir: &Path, file: &str, runtime: &str) {
    let checked = Command::new(env!("CARGO_BIN_EXE_stockd"))
        .args(["plugin", "check", file, "--runtime", runtime, "--cases", "cases.toml"])
        .current_dir(dir)
        .env("XDG_CACHE_HOME", concat!(env!("CARGO_TARGET_TMPDIR"), "/plugin-artifacts"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run stockd plugin check: {e}"));
    assert!(checked.status.success(), "the {runtime} cases pass as written: {}", printed(&checked));
    let report = String::from_utf8_lossy(&checked.stdout);
    assert!(report.contains("2 orders: 0 failed; 2 with expectations, 0 not met"), "{report}");
}

/// `plugin new --lang js` and `--lang python` write projects holding the repository's SDK and
/// WIT, which build with their pinned tools (as `plugins/build-components.sh` installs them)
/// into components that pass `stockd plugin check --runtime js|python --cases cases.toml` as
/// written: the same cases as the Rust template's.
#[tokio::test]
async fn new_js_and_python_plugins_build_and_pass_their_cases() {
    let (node_bin, python_bin) = component_tools();
    let workspace = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));

    let created = stockd(workspace.path(), &["plugin", "new", "js-planner", "--lang", "js"]);
    assert!(created.status.success(), "{}", printed(&created));
    assert!(String::from_utf8_lossy(&created.stdout).contains("Created JavaScript plugin `js-planner`"));
    let js = workspace.path().join("js-planner");
    assert_eq!(read(&js.join("sdk/stockd.js")), repo_file("plugins/js/sdk/stockd.js"));
    assert_eq!(read(&js.join("wit/stockd-plugin.wit")), repo_file("wit/stockd-plugin.wit"));
    // The tools `npm ci` would install, from the suite's cache instead of the network.
    let node_modules = node_bin.parent().unwrap_or_else(|| panic!("{}", node_bin.display()));
    std::os::unix::fs::symlink(node_modules, js.join("node_modules")).unwrap_or_else(|e| panic!("{e}"));
    run_in(&js, Path::new("npm"), &["run", "build"]);
    check_passes(&js, "js-planner.wasm", "js");

    let created = stockd(workspace.path(), &["plugin", "new", "py-planner", "--lang", "python"]);
    assert!(created.status.success(), "{}", printed(&created));
    let python = workspace.path().join("py-planner");
    assert_eq!(read(&python.join("stockd_plugin.py")), repo_file("plugins/python/sdk/stockd_plugin.py"));
    let componentize = python_bin.join("componentize-py");
    let build =
        ["-d", "wit", "-w", "planner", "componentize", "--stub-wasi", "-p", ".", "app", "-o", "py-planner.wasm"];
    run_in(&python, &componentize, &build);
    check_passes(&python, "py-planner.wasm", "python");
}

//! `stockd plugin new NAME [--path DIR] [--sdk PATH] [--lang rust|js|python]`: writes a plugin
//! project that builds into a component and passes `stockd plugin check --cases cases.toml` as
//! it is: a Rust crate (below), or a JavaScript (`--lang js`: `plan.js`, the JavaScript SDK, a
//! `package.json` with componentize-js pinned and its lock) or Python (`--lang python`:
//! `app.py`, the Python SDK, `requirements.txt` with componentize-py pinned) folder, from the
//! templates under `plugins/template-js/` and `plugins/template-python/` and the SDK files of
//! `plugins/js/sdk` and `plugins/python/sdk`, embedded the same way.
//!
//! The SDK is not published, so the binary carries it: the very files of `plugins/sdk` and
//! `wit/stockd-plugin.wit` are compiled in with `include_str!` (never a copy that could drift)
//! and written into the new crate, together with a `Cargo.lock` cut from `plugins/Cargo.lock`
//! down to what the SDK needs, so a new plugin builds against the SDK, WIT and dependency
//! versions this server was built and tested with. `--sdk PATH` uses an existing SDK checkout
//! by path instead. The crate's own files are templates under `plugins/template/`.
//!
//! Layout of a new crate (`vendor/` and `wit/` only without `--sdk`):
//!
//! ```text
//! NAME/Cargo.toml              cdylib, the SDK by path, the release profile, an empty [workspace]
//! NAME/Cargo.lock              the SDK's dependencies at the versions stockd was tested with
//! NAME/src/lib.rs              a commented plan: one inventory target per line, all-or-nothing
//! NAME/cases.toml              sample orders with the plans they must produce
//! NAME/README.md               build, check and upload commands
//! NAME/.gitignore
//! NAME/vendor/stockd-plugin-sdk/{Cargo.toml,src/lib.rs}
//! NAME/wit/stockd-plugin.wit   where the SDK's bindings macro looks: `../../wit` from its crate
//! ```
//!
//! The crate is written into a temporary directory beside its destination and renamed into
//! place at the end, so a failure leaves nothing half-written.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};

/// The SDK's name as a dependency and as a package.
const SDK_PACKAGE: &str = "stockd-plugin-sdk";
/// Where the embedded SDK goes inside a new crate.
const VENDORED_SDK_DIR: &str = "vendor/stockd-plugin-sdk";
/// Longest package name crates.io accepts; cargo new uses the same bound.
const MAX_NAME_LEN: usize = 64;

/// The SDK's files, as `(path inside the SDK crate, contents)`. Each is the repository's own
/// file, so the embedded SDK is always the one `plugins/build.sh` builds the examples with.
pub(crate) const SDK_FILES: &[(&str, &str)] = &[
    ("Cargo.toml", include_str!("../../plugins/sdk/Cargo.toml")),
    ("src/lib.rs", include_str!("../../plugins/sdk/src/lib.rs")),
];
/// The contract the SDK generates its bindings from.
pub(crate) const WIT_FILE: (&str, &str) = ("wit/stockd-plugin.wit", include_str!("../../wit/stockd-plugin.wit"));
/// The lock file the examples and the SDK are built with.
const PLUGINS_LOCK: &str = include_str!("../../plugins/Cargo.lock");

const TEMPLATE_CARGO_TOML: &str = include_str!("../../plugins/template/Cargo.toml");
const TEMPLATE_LIB_RS: &str = include_str!("../../plugins/template/src/lib.rs");
const TEMPLATE_CASES: &str = include_str!("../../plugins/template/cases.toml");
const TEMPLATE_README: &str = include_str!("../../plugins/template/README.md");
const TEMPLATE_GITIGNORE: &str = include_str!("../../plugins/template/gitignore");

/// The JavaScript project: its templates, the SDK (`sdk/` in the project) and the tools' lock.
const JS_TEMPLATES: &[(&str, &str)] = &[
    ("plan.js", include_str!("../../plugins/template-js/plan.js")),
    ("package.json", include_str!("../../plugins/template-js/package.json")),
    ("README.md", include_str!("../../plugins/template-js/README.md")),
    (".gitignore", include_str!("../../plugins/template-js/gitignore")),
];
const JS_SDK_FILES: &[(&str, &str)] = &[
    ("sdk/stockd.js", include_str!("../../plugins/js/sdk/stockd.js")),
    ("sdk/escapes.js", include_str!("../../plugins/js/sdk/escapes.js")),
    ("sdk/engine.d.ts", include_str!("../../plugins/js/sdk/engine.d.ts")),
    ("sdk/types/planner.d.ts", include_str!("../../plugins/js/sdk/types/planner.d.ts")),
];
/// The lock of `plugins/js`, whose package name is this.
const JS_LOCK: &str = include_str!("../../plugins/js/package-lock.json");
const JS_LOCK_NAME: &str = "stockd-js-plugins";

/// The Python project: its templates and the SDK (beside `app.py`).
const PYTHON_TEMPLATES: &[(&str, &str)] = &[
    ("app.py", include_str!("../../plugins/template-python/app.py")),
    ("requirements.txt", include_str!("../../plugins/template-python/requirements.txt")),
    ("README.md", include_str!("../../plugins/template-python/README.md")),
    (".gitignore", include_str!("../../plugins/template-python/gitignore")),
];
const PYTHON_SDK_FILES: &[(&str, &str)] = &[
    ("stockd_plugin.py", include_str!("../../plugins/python/sdk/stockd_plugin.py")),
    ("stockd_plugin_escapes.py", include_str!("../../plugins/python/sdk/stockd_plugin_escapes.py")),
];

/// The language of a new plugin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lang {
    Rust,
    Js,
    Python,
}

impl Lang {
    pub fn parse(name: &str) -> anyhow::Result<Lang> {
        match name {
            "rust" => Ok(Lang::Rust),
            "js" => Ok(Lang::Js),
            "python" => Ok(Lang::Python),
            other => bail!("unknown language {other:?}: rust, js or python"),
        }
    }
}

/// Names cargo refuses for a package, or that would shadow a crate every plugin links.
const RESERVED_NAMES: &[&str] = &[
    "alloc",
    "core",
    "std",
    "proc_macro",
    "proc-macro",
    "test",
    "build",
    "deps",
    "examples",
    "incremental",
    // Windows device names: a folder of that name cannot be created there.
    "con",
    "prn",
    "aux",
    "nul",
    "com1",
    "com2",
    "com3",
    "com4",
    "lpt1",
    "lpt2",
    "lpt3",
];
/// Rust keywords: a library crate cannot be named after one.
const KEYWORDS: &[&str] = &[
    "abstract", "as", "async", "await", "become", "box", "break", "const", "continue", "crate", "do", "dyn", "else",
    "enum", "extern", "false", "final", "fn", "for", "gen", "if", "impl", "in", "let", "loop", "macro", "match", "mod",
    "move", "mut", "override", "priv", "pub", "ref", "return", "self", "static", "struct", "super", "trait", "true",
    "try", "type", "typeof", "unsafe", "unsized", "use", "virtual", "where", "while", "yield",
];

/// Where the new crate's SDK comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SdkSource {
    /// The SDK embedded in this binary, written into the crate under `vendor/`.
    Embedded,
    /// An existing `stockd-plugin-sdk` crate (absolute path), used by path.
    Path(PathBuf),
}

/// What `stockd plugin new` was asked for.
#[derive(Debug, Clone)]
pub struct NewPlugin {
    /// The package name.
    pub name: String,
    /// The folder to create (`./NAME` unless `--path` says otherwise).
    pub dir: PathBuf,
    pub sdk: SdkSource,
    pub lang: Lang,
}

impl NewPlugin {
    /// Validates the name and resolves `--sdk` (the SDK crate itself, or a stockd checkout
    /// holding it at `plugins/sdk`).
    pub fn new(name: &str, dir: Option<&Path>, sdk: Option<&Path>, lang: Lang) -> anyhow::Result<Self> {
        validate_name(name)?;
        let sdk = match (sdk, lang) {
            (None, _) => SdkSource::Embedded,
            (Some(path), Lang::Rust) => SdkSource::Path(find_sdk(path)?),
            (Some(_), _) => bail!("--sdk is for Rust plugins; a JavaScript or Python plugin carries its SDK"),
        };
        let dir = dir.map_or_else(|| PathBuf::from(name), Path::to_path_buf);
        Ok(Self { name: name.to_owned(), dir, sdk, lang })
    }

    /// Every file of the new project, as `(relative path, contents)`.
    pub fn files(&self) -> anyhow::Result<Vec<(String, String)>> {
        match self.lang {
            Lang::Rust => self.rust_files(),
            Lang::Js => Ok(self.js_files()),
            Lang::Python => Ok(self.python_files()),
        }
    }

    /// The JavaScript project: templates, SDK, WIT and the tools' lock under this name.
    fn js_files(&self) -> Vec<(String, String)> {
        let npm_name = self.name.to_ascii_lowercase();
        let fill = |template: &str| {
            template
                .replace("{{name}}", &self.name)
                .replace("{{npm_name}}", &npm_name)
                .replace("{{check_command}}", "npm run check")
                .replace("{{require_user}}", "requireUser")
                .replace("{{plan_file}}", "plan.js")
        };
        let mut files: Vec<(String, String)> =
            JS_TEMPLATES.iter().map(|(path, text)| ((*path).to_owned(), fill(text))).collect();
        files.push(("cases.toml".to_owned(), fill(TEMPLATE_CASES)));
        files.push((
            "package-lock.json".to_owned(),
            JS_LOCK.replace(&format!("\"name\": \"{JS_LOCK_NAME}\""), &format!("\"name\": \"{npm_name}\"")),
        ));
        files.extend(JS_SDK_FILES.iter().map(|(path, text)| ((*path).to_owned(), (*text).to_owned())));
        files.push((WIT_FILE.0.to_owned(), WIT_FILE.1.to_owned()));
        files
    }

    /// The Python project: templates, SDK beside `app.py`, and the WIT.
    fn python_files(&self) -> Vec<(String, String)> {
        let check = format!("stockd plugin check {}.wasm --runtime python --cases cases.toml", self.name);
        let fill = |template: &str| {
            template
                .replace("{{name}}", &self.name)
                .replace("{{check_command}}", &check)
                .replace("{{require_user}}", "require_user")
                .replace("{{plan_file}}", "app.py")
        };
        let mut files: Vec<(String, String)> =
            PYTHON_TEMPLATES.iter().map(|(path, text)| ((*path).to_owned(), fill(text))).collect();
        files.push(("cases.toml".to_owned(), fill(TEMPLATE_CASES)));
        files.extend(PYTHON_SDK_FILES.iter().map(|(path, text)| ((*path).to_owned(), (*text).to_owned())));
        files.push((WIT_FILE.0.to_owned(), WIT_FILE.1.to_owned()));
        files
    }

    /// The Rust crate.
    fn rust_files(&self) -> anyhow::Result<Vec<(String, String)>> {
        let wasm_name = self.name.replace('-', "_");
        let (sdk_path, sdk_comment, sdk_readme, wit_location) = match &self.sdk {
            SdkSource::Embedded => (
                VENDORED_SDK_DIR.to_owned(),
                "The SDK this stockd was built with, written by `stockd plugin new`; keep it as it is.",
                "`vendor/stockd-plugin-sdk/` is the plugin SDK of the stockd that created this crate, and\n\
                 `wit/stockd-plugin.wit` the contract it implements; `Cargo.lock` pins the SDK's\n\
                 dependencies to the versions that stockd was tested with. To move to a newer stockd, create\n\
                 a crate with its `stockd plugin new` and carry `src/` and `cases.toml` over.",
                " (a copy is in `wit/`)",
            ),
            SdkSource::Path(path) => (
                path.to_str().with_context(|| format!("the SDK path {} is not UTF-8", path.display()))?.to_owned(),
                "An existing checkout of the SDK, used by path (`stockd plugin new --sdk`).",
                "The plugin SDK is used from an existing checkout, by path (see `Cargo.toml`).",
                "",
            ),
        };
        let fill = |template: &str| {
            template
                .replace("{{name}}", &self.name)
                .replace("{{wasm_name}}", &wasm_name)
                .replace("{{sdk_path}}", &toml::Value::String(sdk_path.clone()).to_string())
                .replace("{{sdk_comment}}", sdk_comment)
                .replace("{{sdk_readme}}", sdk_readme)
                .replace("{{wit_location}}", wit_location)
                .replace(
                    "{{check_command}}",
                    &format!("stockd plugin check target/wasm32-wasip2/release/{wasm_name}.wasm --cases cases.toml"),
                )
                .replace("{{require_user}}", "require_user")
                .replace("{{plan_file}}", "src/lib.rs")
        };
        let mut files = vec![
            ("Cargo.toml".to_owned(), fill(TEMPLATE_CARGO_TOML)),
            ("Cargo.lock".to_owned(), lock_file(&self.name)?),
            ("src/lib.rs".to_owned(), fill(TEMPLATE_LIB_RS)),
            ("cases.toml".to_owned(), fill(TEMPLATE_CASES)),
            ("README.md".to_owned(), fill(TEMPLATE_README)),
            (".gitignore".to_owned(), TEMPLATE_GITIGNORE.to_owned()),
        ];
        if self.sdk == SdkSource::Embedded {
            files.extend(
                SDK_FILES.iter().map(|(path, text)| (format!("{VENDORED_SDK_DIR}/{path}"), (*text).to_owned())),
            );
            files.push((WIT_FILE.0.to_owned(), WIT_FILE.1.to_owned()));
        }
        Ok(files)
    }

    /// Writes the crate: refuses a destination that exists and is not an empty folder, writes
    /// everything into a temporary folder beside it, then renames that into place.
    pub fn write(&self) -> anyhow::Result<()> {
        match std::fs::read_dir(&self.dir) {
            Ok(mut entries) => {
                if entries.next().is_some() {
                    bail!("{} already exists and is not empty; choose another NAME or --path", self.dir.display());
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => {
                bail!("{} already exists and is not a folder", self.dir.display())
            }
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", self.dir.display())),
        }
        let parent = match self.dir.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent).with_context(|| format!("cannot create {}", parent.display()))?;
        let staging = tempfile::Builder::new()
            .prefix(".stockd-plugin-new-")
            .tempdir_in(&parent)
            .with_context(|| format!("cannot create a temporary folder in {}", parent.display()))?;
        for (path, text) in self.files()? {
            let file = staging.path().join(&path);
            if let Some(folder) = file.parent() {
                std::fs::create_dir_all(folder).with_context(|| format!("cannot create {}", folder.display()))?;
            }
            std::fs::write(&file, text).with_context(|| format!("cannot write {}", file.display()))?;
        }
        // From here the folder is ours to move or remove. An empty destination folder is
        // replaced by the rename (POSIX renames onto an empty directory); a non-empty one was
        // refused above.
        let staged = staging.keep();
        if let Err(e) = std::fs::rename(&staged, &self.dir) {
            // Best effort: the error below is what matters to the user.
            let _ = std::fs::remove_dir_all(&staged);
            return Err(e).with_context(|| format!("cannot create {}", self.dir.display()));
        }
        Ok(())
    }

    /// What to do next, printed after the project is written.
    pub fn next_steps(&self) -> String {
        match self.lang {
            Lang::Rust => self.rust_next_steps(),
            Lang::Js => format!(
                "Created JavaScript plugin `{name}` in {dir}.\n\
                 Next (Node.js 20 or newer):\n  \
                 cd {dir}\n  \
                 npm ci\n  \
                 npm run build\n  \
                 stockd plugin check {name}.wasm --runtime js --cases cases.toml\n\
                 then upload {name}.wasm with PUT /v1/plugin?runtime=js (see README.md).",
                name = self.name,
                dir = self.dir.display(),
            ),
            Lang::Python => format!(
                "Created Python plugin `{name}` in {dir}.\n\
                 Next (Python 3.10 or newer):\n  \
                 cd {dir}\n  \
                 python3 -m venv .venv && .venv/bin/pip install -r requirements.txt\n  \
                 .venv/bin/componentize-py -d wit -w planner componentize --stub-wasi -p . app -o {name}.wasm\n  \
                 stockd plugin check {name}.wasm --runtime python --cases cases.toml\n\
                 then upload {name}.wasm with PUT /v1/plugin?runtime=python (see README.md).",
                name = self.name,
                dir = self.dir.display(),
            ),
        }
    }

    fn rust_next_steps(&self) -> String {
        let wasm = format!("target/wasm32-wasip2/release/{}.wasm", self.name.replace('-', "_"));
        let sdk = match &self.sdk {
            SdkSource::Embedded => "the SDK embedded in this stockd".to_owned(),
            SdkSource::Path(path) => format!("the SDK at {}", path.display()),
        };
        format!(
            "Created plugin crate `{name}` in {dir} (with {sdk}).\n\
             Next:\n  \
             cd {dir}\n  \
             rustup target add wasm32-wasip2        # once\n  \
             cargo build --release --target wasm32-wasip2\n  \
             stockd plugin check {wasm} --cases cases.toml\n\
             then upload {wasm} with PUT /v1/plugin (see README.md).",
            name = self.name,
            dir = self.dir.display(),
        )
    }
}

/// Runs `stockd plugin new`.
pub fn new_plugin(name: &str, dir: Option<&Path>, sdk: Option<&Path>, lang: Lang) -> anyhow::Result<()> {
    let plugin = NewPlugin::new(name, dir, sdk, lang)?;
    plugin.write()?;
    println!("{}", plugin.next_steps());
    Ok(())
}

/// A package name cargo accepts and that does not clash with a crate every plugin links:
/// 1-64 characters of ASCII letters, digits, `-` and `_`, starting with a letter.
fn validate_name(name: &str) -> anyhow::Result<()> {
    let rule = "a plugin name is 1-64 ASCII letters, digits, '-' or '_', starting with a letter";
    let Some(first) = name.chars().next() else { bail!("the plugin name is empty; {rule}") };
    if name.len() > MAX_NAME_LEN {
        bail!("{name:?} is {} characters long; {rule}", name.len());
    }
    if !first.is_ascii_alphabetic() {
        bail!("{name:?} starts with {first:?}; {rule}");
    }
    if let Some(bad) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_')) {
        bail!("{name:?} contains {bad:?}; {rule}");
    }
    let lower = name.to_ascii_lowercase();
    if KEYWORDS.contains(&name) || RESERVED_NAMES.contains(&lower.as_str()) {
        bail!("{name:?} is reserved by Rust or Cargo; choose another name");
    }
    let normalized = lower.replace('_', "-");
    if sdk_packages().is_ok_and(|packages| packages.contains(normalized.as_str())) {
        bail!("{name:?} is the name of a crate the plugin SDK depends on; choose another name");
    }
    Ok(())
}

/// The `stockd-plugin-sdk` crate at `path`, or at `path/plugins/sdk` when `path` is a stockd
/// checkout, as an absolute path (the new crate may live anywhere).
fn find_sdk(path: &Path) -> anyhow::Result<PathBuf> {
    let candidates = [path.to_path_buf(), path.join("plugins").join("sdk")];
    for candidate in &candidates {
        let manifest = candidate.join("Cargo.toml");
        let Ok(text) = std::fs::read_to_string(&manifest) else { continue };
        let name = toml::from_str::<toml::Table>(&text)
            .ok()
            .and_then(|table| table.get("package")?.get("name")?.as_str().map(str::to_owned));
        if name.as_deref() == Some(SDK_PACKAGE) {
            return std::fs::canonicalize(candidate).with_context(|| format!("cannot resolve {}", candidate.display()));
        }
    }
    bail!(
        "--sdk {}: neither it nor its plugins/sdk holds the {SDK_PACKAGE} crate (a Cargo.toml with name = \"{SDK_PACKAGE}\")",
        path.display()
    )
}

/// One `[[package]]` entry of a lock file: its text as cargo wrote it, and what it names.
struct LockEntry {
    text: &'static str,
    name: String,
    version: String,
    dependencies: Vec<String>,
}

/// The entries of `plugins/Cargo.lock` and the text before them (the header).
fn lock_entries() -> anyhow::Result<(&'static str, Vec<LockEntry>)> {
    #[derive(serde::Deserialize)]
    struct Package {
        name: String,
        version: String,
        #[serde(default)]
        dependencies: Vec<String>,
    }
    #[derive(serde::Deserialize)]
    struct Entry {
        package: Vec<Package>,
    }
    // Each entry starts with a `[[package]]` line and runs to the next one.
    let starts: Vec<usize> = PLUGINS_LOCK.match_indices("\n[[package]]\n").map(|(at, _)| at + 1).collect();
    let header = &PLUGINS_LOCK[..starts.first().copied().unwrap_or(PLUGINS_LOCK.len())];
    let ends = starts.iter().skip(1).copied().chain([PLUGINS_LOCK.len()]);
    let entries = starts
        .iter()
        .zip(ends)
        .map(|(&start, end)| {
            let text = &PLUGINS_LOCK[start..end];
            let parsed: Entry = toml::from_str(text).context("plugins/Cargo.lock is not a Cargo lock file")?;
            let Some(package) = parsed.package.into_iter().next() else { bail!("empty entry in plugins/Cargo.lock") };
            Ok(LockEntry { text, name: package.name, version: package.version, dependencies: package.dependencies })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok((header, entries))
}

/// The entries the SDK needs: itself and everything it depends on, transitively. A dependency
/// is written `name` (the only version in the lock) or `name version [(source)]`.
fn sdk_closure(entries: &[LockEntry]) -> anyhow::Result<Vec<&LockEntry>> {
    let mut by_name: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (index, entry) in entries.iter().enumerate() {
        by_name.entry(entry.name.as_str()).or_default().push(index);
    }
    let find = |spec: &str| -> anyhow::Result<usize> {
        let mut words = spec.split_whitespace();
        let name = words.next().unwrap_or_default();
        let version = words.next();
        let candidates = by_name.get(name).map(Vec::as_slice).unwrap_or_default();
        candidates
            .iter()
            .copied()
            .find(|&i| version.is_none_or(|v| entries[i].version == v))
            .with_context(|| format!("plugins/Cargo.lock names {spec:?} but has no entry for it"))
    };
    let mut seen = BTreeSet::new();
    let mut pending = vec![find(SDK_PACKAGE)?];
    while let Some(index) = pending.pop() {
        if seen.insert(index) {
            for spec in &entries[index].dependencies {
                pending.push(find(spec)?);
            }
        }
    }
    // Lock order (cargo sorts by name, then version) is kept by walking the entries in order.
    Ok(seen.into_iter().map(|index| &entries[index]).collect())
}

/// The names of the SDK and its transitive dependencies.
fn sdk_packages() -> anyhow::Result<BTreeSet<String>> {
    let (_, entries) = lock_entries()?;
    Ok(sdk_closure(&entries)?.into_iter().map(|entry| entry.name.clone()).collect())
}

/// The new crate's `Cargo.lock`: the SDK's part of `plugins/Cargo.lock`, in cargo's own format
/// (so `cargo build --locked` accepts it as it is), plus the crate itself in its sorted place.
fn lock_file(name: &str) -> anyhow::Result<String> {
    let (header, entries) = lock_entries()?;
    let own =
        format!("[[package]]\nname = \"{name}\"\nversion = \"0.1.0\"\ndependencies = [\n \"{SDK_PACKAGE}\",\n]\n");
    let mut blocks: Vec<(&str, String)> = sdk_closure(&entries)?
        .into_iter()
        .map(|entry| (entry.name.as_str(), entry.text.trim_end().to_owned()))
        .collect();
    let at = blocks.partition_point(|(other, _)| *other < name);
    blocks.insert(at, (name, own.trim_end().to_owned()));
    let body: Vec<String> = blocks.into_iter().map(|(_, text)| text).collect();
    Ok(format!("{header}{}\n", body.join("\n\n")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_cargo_would_refuse_are_refused_with_the_rule() {
        // Proves NAME validation: valid crate names pass; empty, leading digit, spaces or
        // slashes, too long, keywords, reserved and SDK-dependency names are refused, each
        // with a message saying why.
        for good in ["my-planner", "flash_sale2", "a"] {
            assert!(validate_name(good).is_ok(), "{good}");
        }
        let refused = |name: &str| validate_name(name).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(refused("").contains("is empty"));
        assert!(refused("1plugin").contains("starts with '1'"));
        assert!(refused("my planner").contains("contains ' '"));
        assert!(refused("../evil").contains("starts with '.'"));
        assert!(refused("a/b").contains("contains '/'"));
        assert!(refused(&"a".repeat(65)).contains("65 characters"));
        assert!(refused("fn").contains("reserved"));
        assert!(refused("Core").contains("reserved"));
        assert!(refused("wit_bindgen").contains("SDK depends on"));
        assert!(refused("stockd-plugin-sdk").contains("SDK depends on"));
    }

    #[test]
    fn the_lock_holds_exactly_the_sdk_and_its_dependencies_in_cargo_order() {
        // Proves the new crate's Cargo.lock: the crate itself depending on the SDK, the SDK and
        // wit-bindgen at the versions of plugins/Cargo.lock, no example plugin, sorted by name.
        let lock = lock_file("my-planner").unwrap_or_else(|e| panic!("{e:#}"));
        let parsed: toml::Table = toml::from_str(&lock).unwrap_or_else(|e| panic!("{e}\n{lock}"));
        let names: Vec<&str> = parsed["package"]
            .as_array()
            .map(|packages| packages.iter().filter_map(|p| p["name"].as_str()).collect())
            .unwrap_or_default();
        assert!(names.contains(&"my-planner") && names.contains(&SDK_PACKAGE) && names.contains(&"wit-bindgen"));
        assert!(!names.iter().any(|n| n.starts_with("stockd-plugin-") && *n != SDK_PACKAGE), "{names:?}");
        let mut sorted = names.clone();
        sorted.sort_unstable();
        assert_eq!(names, sorted);
        assert!(lock.starts_with("# This file is automatically @generated by Cargo.\n"), "{lock}");
        assert!(
            lock.contains("name = \"my-planner\"\nversion = \"0.1.0\"\ndependencies = [\n \"stockd-plugin-sdk\",\n]\n")
        );
    }

    #[test]
    fn the_embedded_sdk_finds_the_wit_where_the_new_crate_puts_it() {
        // Proves the layout matches the SDK: its bindings macro reads `../../wit`, which from
        // vendor/stockd-plugin-sdk is the crate's own wit/ folder.
        let lib = SDK_FILES.iter().find(|(path, _)| *path == "src/lib.rs").map(|(_, text)| *text).unwrap_or_default();
        // In the repository `plugins/sdk` -> `wit/`; in a new crate `vendor/stockd-plugin-sdk`
        // -> `wit/`, the same two levels up.
        assert!(lib.contains("path: \"../../wit\""), "the SDK no longer reads ../../wit; update VENDORED_SDK_DIR");
        let plugin = NewPlugin::new("my-planner", None, None, Lang::Rust).unwrap_or_else(|e| panic!("{e:#}"));
        let files = plugin.files().unwrap_or_else(|e| panic!("{e:#}"));
        let paths: Vec<&str> = files.iter().map(|(path, _)| path.as_str()).collect();
        assert!(paths.contains(&"wit/stockd-plugin.wit") && paths.contains(&"vendor/stockd-plugin-sdk/src/lib.rs"));
        assert!(files.iter().all(|(_, text)| !text.contains("{{")), "every placeholder is filled");
    }

    /// A JavaScript or Python project holds its plan, its SDK where the plan imports it from,
    /// the WIT, and its tools pinned (the lock under the project's own name); no placeholder is
    /// left; `--sdk` is refused for them.
    #[test]
    fn js_and_python_projects_hold_their_sdk_wit_and_pinned_tools() {
        let js = NewPlugin::new("My-Planner", None, None, Lang::Js).unwrap_or_else(|e| panic!("{e:#}"));
        let files = js.files().unwrap_or_else(|e| panic!("{e:#}"));
        let file = |files: &[(String, String)], path: &str| {
            files.iter().find(|(p, _)| p == path).map(|(_, text)| text.clone()).unwrap_or_else(|| panic!("{path}"))
        };
        assert!(file(&files, "plan.js").contains("from \"./sdk/stockd.js\""));
        assert!(file(&files, "sdk/stockd.js").contains("export function planned"));
        assert!(file(&files, "package.json").contains("\"name\": \"my-planner\""));
        let lock = file(&files, "package-lock.json");
        assert!(lock.contains("\"name\": \"my-planner\"") && !lock.contains(JS_LOCK_NAME));
        assert!(file(&files, "cases.toml").contains("npm run check"));
        assert!(files.iter().any(|(p, _)| p == "wit/stockd-plugin.wit"));
        assert!(files.iter().all(|(_, text)| !text.contains("{{")), "every placeholder is filled");

        let python = NewPlugin::new("planner", None, None, Lang::Python).unwrap_or_else(|e| panic!("{e:#}"));
        let files = python.files().unwrap_or_else(|e| panic!("{e:#}"));
        assert!(file(&files, "app.py").contains("from stockd_plugin import"));
        assert!(file(&files, "stockd_plugin.py").contains("def planned("));
        assert!(file(&files, "requirements.txt").contains("componentize-py=="));
        assert!(file(&files, "cases.toml").contains("--runtime python"));
        // The SDK is written as it is (its Python holds literal braces); the templates are filled.
        let templates = files.iter().filter(|(path, _)| !path.starts_with("stockd_plugin"));
        assert!(templates.clone().all(|(_, text)| !text.contains("{{")), "every placeholder is filled");

        let sdk = NewPlugin::new("planner", None, Some(Path::new(".")), Lang::Js).map(|_| ());
        assert!(sdk.is_err_and(|e| e.to_string().contains("--sdk is for Rust")));
    }
}

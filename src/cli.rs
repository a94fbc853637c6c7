//! The `stockd` command line: thin wrappers around [`crate::startup`].

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::config::Config;

#[derive(Debug, Parser)]
#[command(name = "stockd", version, about = "Deducts consumable resources exactly once, under any load")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the server (embedded SQLite under ./data/ unless configured otherwise).
    Serve {
        /// TOML config file; environment variables override it.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Apply database migrations and exit.
    Migrate {
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Run the load generator: scenarios and baselines against a fresh server (or `--url`).
    Bench(crate::bench::BenchArgs),
    /// Work with tenant plugins.
    Plugin {
        #[command(subcommand)]
        command: PluginCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum PluginCommand {
    /// Validate a plugin component and print its plans for sample orders.
    Check {
        /// The component (.wasm).
        file: PathBuf,
        /// A TOML file of sample orders (see plugins/README.md); a built-in sample otherwise.
        #[arg(long)]
        cases: Option<PathBuf>,
        /// The server's config file: check under its `[plugins]` limits (defaults otherwise).
        #[arg(long)]
        config: Option<PathBuf>,
        /// The language profile whose limits apply, as the upload's `?runtime=` would choose.
        #[arg(long, default_value = "rust", value_parser = ["rust", "js", "python"])]
        runtime: String,
    },
    /// Create a plugin crate that builds and passes `plugin check --cases cases.toml` as it is.
    New {
        /// The crate's name: 1-64 ASCII letters, digits, '-' or '_', starting with a letter.
        name: String,
        /// The folder to create (default: ./NAME); it must not exist or be empty.
        #[arg(long)]
        path: Option<PathBuf>,
        /// Use this `stockd-plugin-sdk` crate (or a stockd checkout holding it at
        /// plugins/sdk) by path instead of the SDK embedded in this binary.
        #[arg(long)]
        sdk: Option<PathBuf>,
        /// The plugin's language: a Rust crate, or a JavaScript or Python project.
        #[arg(long, default_value = "rust", value_parser = ["rust", "js", "python"])]
        lang: String,
    },
}

/// Parses arguments and runs the chosen command.
pub async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    crate::telemetry::init_tracing();
    match cli.command {
        Command::Serve { config } => crate::startup::serve(Config::load(config.as_deref())?).await,
        Command::Migrate { config } => {
            let config = Config::load(config.as_deref())?;
            crate::startup::migrate(&config).await?;
            println!("migrations applied");
            Ok(())
        }
        Command::Bench(args) => crate::bench::run(args).await,
        Command::Plugin { command: PluginCommand::Check { file, cases, config, runtime } } => {
            let runtime = crate::plugin::Runtime::parse(&runtime)
                .ok_or_else(|| anyhow::anyhow!("unknown runtime {runtime:?}: rust, js or python"))?;
            let plugins = Config::load(config.as_deref())?.plugins;
            let limits = plugins
                .limits_for(runtime)
                .ok_or_else(|| anyhow::anyhow!("the {runtime} runtime is disabled in this config"))?;
            // The server's artifact directory: a component checked here is mapped, not compiled,
            // by a server of this user on this machine (and a second check is quick).
            let artifacts = match plugins.artifact_dir() {
                Some(dir) => match crate::plugin::ArtifactStore::open(&dir, plugins.max_artifact_dir_bytes) {
                    Ok(store) => Some(std::sync::Arc::new(store)),
                    Err(e) => {
                        eprintln!("stockd: not keeping the compiled plugin: {e:#}");
                        None
                    }
                },
                None => None,
            };
            crate::plugin::check(&file, cases.as_deref(), runtime, limits, artifacts).await
        }
        Command::Plugin { command: PluginCommand::New { name, path, sdk, lang } } => {
            let lang = crate::plugin::scaffold::Lang::parse(&lang)?;
            crate::plugin::scaffold::new_plugin(&name, path.as_deref(), sdk.as_deref(), lang)
        }
    }
}

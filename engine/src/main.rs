//! `bmoe-cli`: run a MoE model from a GGUF file (`bmoe-cli -m MODEL -p PROMPT -n N`), or
//! one of the tools beside it: `gen` (write a synthetic model), `inspect` (describe a file),
//! `bench` (kernel and memory bandwidth), `checksum` (per-expert checksums for
//! `--verify-reads`).

use anyhow::{bail, Result};
use bmoe_engine::cli::{self, Cli, Cmd};

fn main() {
    let cli = match Cli::parse_argv(std::env::args_os()) {
        Ok(c) => c,
        Err(e) => {
            // Unknown flag: exit 1; bad value: exit 2 (features.md §14).
            let code = match e.kind() {
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => 0,
                clap::error::ErrorKind::UnknownArgument => 1,
                _ => 2,
            };
            let _ = e.print();
            std::process::exit(code);
        }
    };
    let r: Result<i32> = match cli.cmd {
        Some(Cmd::Gen(a)) => cli::gen(a).map(|_| 0),
        Some(Cmd::Inspect(a)) => cli::inspect(a).map(|_| 0),
        Some(Cmd::Bench(a)) => cli::bench(a).map(|_| 0),
        Some(Cmd::Checksum(a)) => cli::checksum(a).map(|_| 0),
        Some(Cmd::Serve(a)) => serve(a),
        Some(Cmd::Chat(mut a)) => {
            env_fallbacks(&mut a.run).and_then(|_| bmoe_engine::chat_tty::chat(a))
        }
        None => run(cli),
    };
    match r {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            // Each cause once: many errors already print their OS error in their message.
            eprintln!(
                "bmoe: error: {}",
                bmoe_core::telemetry::fmt::error_text(e.as_ref())
            );
            std::process::exit(1);
        }
    }
}

fn run(cli: Cli) -> Result<i32> {
    if cli.run.list_archs {
        // One line per architecture: its name, what it is, and the `gen --arch` presets.
        for e in bmoe_engine::arch::REGISTRY {
            let presets = bmoe_engine::gen::GenArch::from_name(e.name)
                .map(|a| a.presets().join(", "))
                .unwrap_or_else(|| "none".into());
            cli::stdout_text(&format!(
                "{}\t{}\tgen presets: {presets}\n",
                e.name, e.about
            ))?;
        }
        return Ok(0);
    }
    let Some(model) = cli.run.model.clone() else {
        bail!(
            "no model given: pass -m MODEL.gguf (or a subcommand: gen, inspect, bench; see --help)"
        );
    };
    let mut run = cli.run.clone();
    env_fallbacks(&mut run)?;
    {
        use std::io::IsTerminal;
        let stdin = std::io::stdin();
        let tty = stdin.is_terminal();
        run.resolve_prompt(&mut stdin.lock(), tty)?;
        if tty && run.prompt.is_empty() && !run.session && !run.decide {
            // A bare `bmoe-cli -m M` typed at a terminal: what the user most likely wants.
            bail!(
                "no prompt: pass -p TEXT or -f FILE, or pipe one on stdin; to talk with the model, run:\n  bmoe-cli chat -m {}",
                model.display()
            );
        }
    }
    let cancel = bmoe_core::CancelFlag::new();
    watch_signals(&cancel)?;
    if run.session {
        let stdin = std::io::stdin();
        let stderr = std::io::stderr();
        return bmoe_engine::session::serve(
            &run,
            &model,
            Box::new(std::io::BufReader::new(stdin)),
            Box::new(std::io::stdout()),
            &mut stderr.lock(),
            &cancel,
        );
    }
    bmoe_engine::run::generate(&run, &model, &cancel)
}

/// Environment fallbacks (BMOE_CACHE_MB, ...): a flag the user typed always wins.
fn env_fallbacks(run: &mut bmoe_engine::cli::RunArgs) -> Result<()> {
    for (k, v) in
        bmoe_flags::apply_env_fallbacks(std::env::vars(), &mut run.stream, &mut run.telemetry)?
    {
        eprintln!("bmoe: {k}={v} (from the environment)");
    }
    Ok(())
}

/// `bmoe-cli serve`: SIGINT/SIGTERM stop the server (the running generation at its next
/// token); a second signal ends the process at once.
fn serve(mut a: bmoe_engine::cli::ServeArgs) -> Result<i32> {
    env_fallbacks(&mut a.run)?;
    let cancel = bmoe_core::CancelFlag::new();
    watch_signals(&cancel)?;
    bmoe_engine::serve::serve(a, &cancel)
}

/// SIGINT and SIGTERM set `cancel`: the generation stops at its next token boundary, writes
/// every row and its summary (`interrupted=1`), leaves the traces on a whole step, and the
/// process exits 130. A second signal while the first is being honoured ends the process at
/// once, with the same code (the user insists).
fn watch_signals(cancel: &bmoe_core::CancelFlag) -> Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    for sig in [SIGINT, SIGTERM] {
        // Registered first, so it sees the flag as the previous signal left it: a no-op on
        // the first signal, an exit on the second.
        signal_hook::flag::register_conditional_shutdown(
            sig,
            bmoe_engine::run::EXIT_INTERRUPTED,
            cancel.atomic().clone(),
        )?;
        signal_hook::flag::register(sig, cancel.atomic().clone())?;
    }
    Ok(())
}

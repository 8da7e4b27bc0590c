//! `bmoe-sim`: replay route traces through the bmoe core on a modelled device, sweep budgets
//! and policies, compare simulated and measured runs, and calibrate device profiles. The
//! program is `bmoe_sim::cli::run`; this file only connects it to the process.

fn main() {
    let env: Vec<(String, String)> = std::env::vars().collect();
    let stdout = std::io::stdout();
    let stderr = std::io::stderr();
    let code = bmoe_sim::cli::run(
        std::env::args_os(),
        &env,
        &mut stdout.lock(),
        &mut stderr.lock(),
    );
    std::process::exit(code);
}

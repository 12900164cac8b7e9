//! Command-line parsing for every ctxsync binary: `--help` never prints the
//! value of an env var it read. clap shows `[env: NATS_URL=nats://u:pw@…]`
//! by default, and NATS_URL, DATABASE_URL and tokens carry credentials; so
//! every argument of every (sub)command gets `hide_env_values`, including
//! ones added later, instead of an attribute to remember on each.

use clap::{ArgMatches, Command, FromArgMatches, Parser};

/// `T::parse()`, with every env value hidden from `--help` (clap exits on
/// `--help`, `--version` and errors, as `parse` does).
pub fn parse<T: Parser>() -> T {
    parse_from(std::env::args_os())
}

/// [`parse`] over given arguments (the first is the binary's name).
pub fn parse_from<T: Parser, I, A>(args: I) -> T
where
    I: IntoIterator<Item = A>,
    A: Into<std::ffi::OsString> + Clone,
{
    let mut command = command::<T>();
    let mut matches: ArgMatches = command
        .clone()
        .try_get_matches_from(args)
        .unwrap_or_else(|e| naming_env_vars(&mut command, e).exit());
    T::from_arg_matches_mut(&mut matches).unwrap_or_else(|e| e.format(&mut command).exit())
}

/// `error`, where it is of required settings not given, naming each one's
/// env var too: an operator sets them in a manifest's env, not as flags,
/// and clap's own message names only the flags.
fn naming_env_vars(command: &mut Command, error: clap::Error) -> clap::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if error.kind() != ErrorKind::MissingRequiredArgument {
        return error;
    }
    let Some(ContextValue::Strings(missing)) = error.get(ContextKind::InvalidArg) else {
        return error;
    };
    let named: Vec<String> = missing
        .iter()
        .map(|usage| {
            let long = usage
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .trim_start_matches("--");
            let env = command
                .get_arguments()
                .find(|a| a.get_long() == Some(long))
                .and_then(|a| a.get_env());
            match env {
                Some(env) => format!("{usage} (env {})", env.to_string_lossy()),
                None => usage.clone(),
            }
        })
        .collect();
    clap::Error::raw(
        ErrorKind::MissingRequiredArgument,
        format!("required settings are not given: {}\n", named.join(", ")),
    )
    .format(command)
}

/// `T`'s command with every env value hidden, in every subcommand.
pub fn command<T: Parser>() -> Command {
    hide_env_values(T::command())
}

/// `T` at its flags' defaults: no argument given and no env var read. A
/// configuration's `Default` is this, so the defaults written in its clap
/// definition are the only ones (never restated beside it).
///
/// # Panics
/// When `T` has a required flag (see [`defaults_with`]) or a default its own
/// parser refuses: a mistake in `T`'s definition, which every test of `T` finds.
pub fn defaults<T: clap::Args + FromArgMatches>() -> T {
    defaults_with(&[])
}

/// [`defaults`], with `args` given (for a required flag, which has no default).
///
/// # Panics
/// As [`defaults`].
pub fn defaults_with<T: clap::Args + FromArgMatches>(args: &[&str]) -> T {
    let command =
        T::augment_args(Command::new("defaults")).mut_args(|arg| arg.env(None::<&'static str>));
    let matches = command
        .try_get_matches_from(std::iter::once("defaults").chain(args.iter().copied()))
        .unwrap_or_else(|e| panic!("the defaults of {} do not parse: {e}", type_name::<T>()));
    T::from_arg_matches(&matches)
        .unwrap_or_else(|e| panic!("the defaults of {} do not parse: {e}", type_name::<T>()))
}

fn type_name<T>() -> &'static str {
    std::any::type_name::<T>()
}

fn hide_env_values(command: Command) -> Command {
    command
        .mut_args(|arg| arg.hide_env_values(true))
        .mut_subcommands(hide_env_values)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Parser, Debug)]
    struct Cli {
        #[arg(long, env = "ARGS_TEST_URL")]
        url: Option<String>,
        #[command(subcommand)]
        command: Option<Sub>,
    }

    #[derive(clap::Subcommand, Debug)]
    enum Sub {
        Run {
            #[arg(long, env = "ARGS_TEST_TOKEN")]
            token: Option<String>,
        },
    }

    #[derive(clap::Args, Debug, PartialEq)]
    struct Settings {
        #[arg(long, env = "ARGS_TEST_DEFAULTS_WAIT", default_value = "3s", value_parser = humantime::parse_duration)]
        wait: std::time::Duration,
        #[arg(long, env = "ARGS_TEST_DEFAULTS_PATH")]
        path: std::path::PathBuf,
    }

    #[test]
    fn defaults_are_the_clap_definitions() {
        let settings: Settings = defaults_with(&["--path", "/x"]);
        assert_eq!(
            settings,
            Settings {
                wait: std::time::Duration::from_secs(3),
                path: "/x".into(),
            }
        );
        let error = std::panic::catch_unwind(defaults::<Settings>).unwrap_err();
        let message = error.downcast_ref::<String>().unwrap();
        assert!(message.contains("--path"), "{message}");
    }

    /// Run by [`defaults_read_no_env_var`] with the variable set.
    #[test]
    #[ignore = "run by defaults_read_no_env_var, in a process of its own"]
    fn defaults_with_the_env_var_set() {
        let settings: Settings = defaults_with(&["--path", "/x"]);
        assert_eq!(settings.wait, std::time::Duration::from_secs(3));
    }

    #[test]
    fn defaults_read_no_env_var() {
        // The variable is set for a process of this test binary alone: a
        // test cannot set one in its own process (no unsafe code here).
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "args::tests::defaults_with_the_env_var_set",
            ])
            .env("ARGS_TEST_DEFAULTS_WAIT", "9s")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&child.stdout);
        assert!(
            child.status.success(),
            "the defaults read the env var: {stdout}"
        );
        assert!(stdout.contains("1 passed"), "{stdout}");
    }

    #[derive(Parser, Debug)]
    struct Required {
        #[arg(long, env = "ARGS_TEST_REQUIRED_CONFIG")]
        config: std::path::PathBuf,
        #[arg(long)]
        flag_only: String,
    }

    #[test]
    fn a_missing_setting_is_named_with_its_env_var() {
        let mut command = command::<Required>();
        let error = command
            .clone()
            .try_get_matches_from(["service"])
            .unwrap_err();
        let message = naming_env_vars(&mut command, error).to_string();
        assert!(
            message.contains("--config <CONFIG> (env ARGS_TEST_REQUIRED_CONFIG)"),
            "{message}"
        );
        assert!(message.contains("--flag-only <FLAG_ONLY>"), "{message}");
        assert!(
            message.starts_with("error: required settings are not given"),
            "{message}"
        );
    }

    #[test]
    fn help_names_env_vars_but_never_their_values() {
        let mut command = command::<Cli>();
        for arg in command.get_arguments() {
            if arg.get_env().is_some() {
                assert!(arg.is_hide_env_values_set(), "{:?}", arg.get_id());
            }
        }
        let help = command.render_long_help().to_string();
        assert!(help.contains("ARGS_TEST_URL"), "{help}");
        let run = command.find_subcommand_mut("run").unwrap();
        let arg = run.get_arguments().find(|a| a.get_id() == "token").unwrap();
        assert!(arg.is_hide_env_values_set());
    }
}

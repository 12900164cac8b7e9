//! Command-line parsing for every ctxsync binary: `--help` never prints the
//! value of an env var it read. clap shows `[env: NATS_URL=nats://u:pw@…]`
//! by default, and NATS_URL, DATABASE_URL and tokens carry credentials; so
//! every argument of every (sub)command gets `hide_env_values`, including
//! ones added later, instead of an attribute to remember on each.

use clap::{ArgMatches, Command, Parser};

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
    let mut matches: ArgMatches = command.clone().get_matches_from(args);
    T::from_arg_matches_mut(&mut matches).unwrap_or_else(|e| e.format(&mut command).exit())
}

/// `T`'s command with every env value hidden, in every subcommand.
pub fn command<T: Parser>() -> Command {
    hide_env_values(T::command())
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

//! A parsed configuration back into the env vars its binary's parser reads.
//!
//! Generic over the service's clap definition: every flag of `T`'s command
//! is rendered from the field of the same id (configurations are
//! `Serialize`, field by field under their flags' ids, flattened parts
//! flattened), and a flag without a field, a field without a flag or a flag
//! without an env var is an error. So a flag added to a service reaches its
//! binary without a line here, and none can be dropped on the way.
//!
//! Everything goes by env, nothing on the command line: URLs may carry
//! passwords, and a process's arguments are anyone's to read (`ps`).

use clap::Command;
use serde_json::Value;

/// A configuration that cannot be rendered: a mistake in its definition.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    #[error("the configuration does not serialize to fields: {0}")]
    Serialize(String),
    #[error("flag --{id} has no env var to pass it by")]
    NoEnv { id: String },
    #[error("flag --{id} has no field of the same name in the configuration")]
    NoField { id: String },
    #[error("field {id} of the configuration is no flag of the service")]
    NoFlag { id: String },
    #[error("field {id} is {kind}, not a value its flag reads")]
    NotAValue { id: String, kind: &'static str },
}

/// `config` as the env vars its binary reads, in its flags' order; a field
/// that is unset (`None`) is left out, so the flag has its default (none).
pub fn env_of<T: clap::Args + serde::Serialize>(
    config: &T,
) -> Result<Vec<(String, String)>, RenderError> {
    let command = T::augment_args(Command::new("render"));
    let fields = match serde_json::to_value(config) {
        Ok(Value::Object(fields)) => fields,
        Ok(_) => return Err(RenderError::Serialize("not a struct".into())),
        Err(error) => return Err(RenderError::Serialize(error.to_string())),
    };
    let flags: Vec<&clap::Arg> = command.get_arguments().collect();
    if let Some(id) = fields
        .keys()
        .find(|id| !flags.iter().any(|flag| flag.get_id() == id.as_str()))
    {
        return Err(RenderError::NoFlag { id: id.clone() });
    }
    let mut env = Vec::with_capacity(flags.len());
    for flag in flags {
        let id = flag.get_id().as_str();
        let Some(name) = flag.get_env() else {
            return Err(RenderError::NoEnv { id: id.to_owned() });
        };
        let field = fields
            .get(id)
            .ok_or_else(|| RenderError::NoField { id: id.to_owned() })?;
        let not_a_value = |kind| RenderError::NotAValue {
            id: id.to_owned(),
            kind,
        };
        let value = match field {
            Value::Null => continue,
            Value::String(text) => text.clone(),
            Value::Bool(value) => value.to_string(),
            Value::Number(number) => number.to_string(),
            Value::Array(_) => return Err(not_a_value("a list")),
            Value::Object(_) => return Err(not_a_value("a struct")),
        };
        env.push((name.to_string_lossy().into_owned(), value));
    }
    Ok(env)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Args, serde::Serialize)]
    struct Config {
        #[arg(long, env = "RENDER_URL")]
        url: String,
        #[arg(long, env = "RENDER_COUNT", default_value_t = 3)]
        count: usize,
        #[arg(long, env = "RENDER_ON", default_value_t = true, action = clap::ArgAction::Set)]
        on: bool,
        #[arg(long, env = "RENDER_WAIT", value_parser = humantime::parse_duration)]
        #[serde(serialize_with = "ctxsync_runtime::config::humantime_string")]
        wait: std::time::Duration,
        #[arg(long, env = "RENDER_PATH")]
        path: Option<std::path::PathBuf>,
    }

    #[test]
    fn every_flag_is_rendered_from_its_field_by_its_env_var() {
        let env = env_of(&Config {
            url: "nats://u:pw@h".into(),
            count: 7,
            on: false,
            wait: std::time::Duration::from_millis(1500),
            path: None,
        })
        .unwrap();
        let env: Vec<(&str, &str)> = env.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        assert_eq!(
            env,
            [
                ("RENDER_URL", "nats://u:pw@h"),
                ("RENDER_COUNT", "7"),
                ("RENDER_ON", "false"),
                ("RENDER_WAIT", "1s 500ms"),
            ]
        );
    }

    #[derive(clap::Args, serde::Serialize)]
    struct NoEnv {
        #[arg(long)]
        url: String,
    }

    #[derive(clap::Args, serde::Serialize)]
    struct Skipped {
        #[arg(long, env = "RENDER_URL")]
        #[serde(skip)]
        url: String,
    }

    #[derive(clap::Args, serde::Serialize)]
    struct Extra {
        #[arg(long, env = "RENDER_URL")]
        url: String,
        #[arg(skip)]
        extra: u32,
    }

    #[derive(clap::Args, serde::Serialize)]
    struct RawDuration {
        #[arg(long, env = "RENDER_WAIT", value_parser = humantime::parse_duration)]
        wait: std::time::Duration,
    }

    #[test]
    fn a_setting_that_cannot_reach_the_binary_is_an_error() {
        let url = String::from("u");
        assert!(matches!(
            env_of(&NoEnv { url: url.clone() }),
            Err(RenderError::NoEnv { id }) if id == "url"
        ));
        assert!(matches!(
            env_of(&Skipped { url: url.clone() }),
            Err(RenderError::NoField { id }) if id == "url"
        ));
        assert!(matches!(
            env_of(&Extra { url, extra: 1 }),
            Err(RenderError::NoFlag { id }) if id == "extra"
        ));
        // A duration needs its flag's syntax (humantime), not serde's struct.
        assert!(matches!(
            env_of(&RawDuration { wait: std::time::Duration::from_secs(1) }),
            Err(RenderError::NotAValue { id, kind: "a struct" }) if id == "wait"
        ));
    }
}

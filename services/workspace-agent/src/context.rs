//! Instruction files and skills: read from the resolved context config, one
//! resource per source.
//!
//! Statuses:
//! * instruction file — ok (content capped at 64 KiB, `truncated` set when
//!   cut), unreadable (permissions, a directory, an I/O error), invalid (not
//!   UTF-8 text), oversize (over 1 MiB: not read at all, such a file is not an
//!   instructions file). A missing file has no row.
//! * skill — ok, invalid (missing or malformed front matter, no name or
//!   description; the reason is the error), unreadable, oversize (meta file over
//!   64 KiB), excluded (a skill of the same name was found first).

use std::collections::BTreeSet;
use std::fs;
use std::io::{ErrorKind, Read};
use std::path::{Path, PathBuf};

use ctxsync_proto::v1::{self, ResourceKind, ResourceStatus, context_resource::Body};

use crate::context_config::ContextConfig;
use crate::text::floor_char_boundary;

/// Instruction file content sent at most, in bytes.
pub const MAX_INSTRUCTION_CONTENT_BYTES: usize = 64 * 1024;
/// Instruction files larger than this are not read (status oversize).
pub const MAX_INSTRUCTION_FILE_BYTES: u64 = 1024 * 1024;
/// Skill meta files larger than this are not parsed (status oversize).
pub const MAX_SKILL_META_BYTES: u64 = 64 * 1024;

pub fn instruction_source(path: &Path) -> String {
    format!("instruction_file:{}", path.display())
}

pub fn skill_source(dir: &Path) -> String {
    format!("skill:{}", dir.display())
}

/// A file's identity on disk, so one file reached by two paths is read once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct FileId {
    dev: u64,
    ino: u64,
}

pub fn file_id(path: &Path) -> Option<FileId> {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(path).ok().map(|m| FileId {
        dev: m.dev(),
        ino: m.ino(),
    })
}

/// The instruction file of every instructions dir, then of the working
/// directory; the same file (by path or by identity) is read once.
pub fn read_instruction_files(config: &ContextConfig) -> Vec<v1::ContextResource> {
    let mut candidates: Vec<PathBuf> = config
        .instructions_dirs
        .iter()
        .map(|dir| dir.join(&config.instructions_file))
        .collect();
    if let Some(working_dir) = &config.working_dir {
        candidates.push(working_dir.join(&config.instructions_file));
    }
    let mut seen_paths = BTreeSet::new();
    let mut seen_ids = BTreeSet::new();
    let mut resources = Vec::new();
    for path in candidates {
        if !seen_paths.insert(path.clone()) {
            continue;
        }
        match fs::symlink_metadata(&path) {
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            _ => {}
        }
        if let Some(id) = file_id(&path)
            && !seen_ids.insert(id)
        {
            continue;
        }
        resources.push(read_instruction_file(&path));
    }
    resources
}

fn read_instruction_file(path: &Path) -> v1::ContextResource {
    let mut resource = v1::ContextResource {
        source: instruction_source(path),
        kind: ResourceKind::InstructionFile as i32,
        status: ResourceStatus::Ok as i32,
        body: Some(Body::InstructionFile(v1::InstructionFile {
            path: path.display().to_string(),
            content: String::new(),
            truncated: false,
        })),
        ..Default::default()
    };
    let fail = |mut r: v1::ContextResource, status: ResourceStatus, error: String| {
        r.status = status as i32;
        r.error = error;
        r
    };
    let metadata = match fs::metadata(path) {
        Ok(m) => m,
        Err(e) => return fail(resource, ResourceStatus::Unreadable, io_reason(&e)),
    };
    if !metadata.is_file() {
        return fail(
            resource,
            ResourceStatus::Unreadable,
            "not a regular file".to_owned(),
        );
    }
    if metadata.len() > MAX_INSTRUCTION_FILE_BYTES {
        return fail(
            resource,
            ResourceStatus::Oversize,
            format!(
                "file is {} bytes, over the {MAX_INSTRUCTION_FILE_BYTES}-byte limit for instruction files",
                metadata.len()
            ),
        );
    }
    let bytes = match read_capped(path, MAX_INSTRUCTION_FILE_BYTES) {
        Ok(b) => b,
        Err(e) => return fail(resource, ResourceStatus::Unreadable, io_reason(&e)),
    };
    let text = match String::from_utf8(bytes) {
        Ok(t) => t,
        Err(_) => {
            return fail(
                resource,
                ResourceStatus::Invalid,
                "not UTF-8 text".to_owned(),
            );
        }
    };
    // A file may hold NUL (storable nowhere) or terminal escapes: cleaned
    // before the cut, so the cut measures what is sent.
    let text = ctxsync_mcp::clean_text(&text);
    let total = text.len();
    let keep = floor_char_boundary(&text, MAX_INSTRUCTION_CONTENT_BYTES);
    let truncated = keep < total;
    if truncated {
        resource.warning = format!(
            "content truncated to {keep} of {total} bytes (limit {MAX_INSTRUCTION_CONTENT_BYTES})"
        );
    }
    resource.body = Some(Body::InstructionFile(v1::InstructionFile {
        path: path.display().to_string(),
        content: text[..keep].to_owned(),
        truncated,
    }));
    resource
}

/// Reads at most `max` bytes (the file may grow between stat and read).
fn read_capped(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    fs::File::open(path)?.take(max).read_to_end(&mut buf)?;
    Ok(buf)
}

pub(crate) fn io_reason(error: &std::io::Error) -> String {
    match error.kind() {
        ErrorKind::PermissionDenied => "permission denied".to_owned(),
        ErrorKind::NotFound => "not found".to_owned(),
        _ => {
            // The io::Error text names no path, only the OS reason.
            let text = error.to_string();
            text.split(" (os error").next().unwrap_or(&text).to_owned()
        }
    }
}

/// Every directory directly under a skills dir that holds the meta file.
/// Skill names are unique: a later skill with a name already found is excluded.
pub fn read_skills(config: &ContextConfig) -> Vec<v1::ContextResource> {
    let mut resources = Vec::new();
    let mut names = BTreeSet::new();
    let mut seen_dirs = BTreeSet::new();
    for skills_dir in &config.skills_dirs {
        let entries = match fs::read_dir(skills_dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(e) => {
                tracing::warn!(dir = %skills_dir.display(), reason = %io_reason(&e), "cannot list skills dir");
                continue;
            }
        };
        let mut dirs: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.is_dir() && p.join(&config.skill_meta_file).exists())
            .collect();
        dirs.sort();
        for dir in dirs {
            if let Some(id) = file_id(&dir)
                && !seen_dirs.insert(id)
            {
                continue;
            }
            let mut resource = read_skill(&dir, &config.skill_meta_file);
            if resource.status == ResourceStatus::Ok as i32
                && let Some(Body::Skill(skill)) = &resource.body
                && !names.insert(skill.name.clone())
            {
                resource.status = ResourceStatus::Excluded as i32;
                resource.warning = format!(
                    "a skill named {:?} was found earlier; this one is not used",
                    skill.name
                );
            }
            resources.push(resource);
        }
    }
    resources
}

fn read_skill(dir: &Path, meta_file: &str) -> v1::ContextResource {
    let mut resource = v1::ContextResource {
        source: skill_source(dir),
        kind: ResourceKind::Skill as i32,
        status: ResourceStatus::Ok as i32,
        body: Some(Body::Skill(v1::Skill {
            dir: dir.display().to_string(),
            name: String::new(),
            description: String::new(),
        })),
        ..Default::default()
    };
    let meta_path = dir.join(meta_file);
    let outcome = match fs::metadata(&meta_path) {
        Err(e) => Err((
            ResourceStatus::Unreadable,
            format!("{meta_file}: {}", io_reason(&e)),
        )),
        Ok(m) if !m.is_file() => Err((
            ResourceStatus::Unreadable,
            format!("{meta_file}: not a regular file"),
        )),
        Ok(m) if m.len() > MAX_SKILL_META_BYTES => Err((
            ResourceStatus::Oversize,
            format!(
                "{meta_file} is {} bytes, over the {MAX_SKILL_META_BYTES}-byte limit",
                m.len()
            ),
        )),
        Ok(_) => match read_capped(&meta_path, MAX_SKILL_META_BYTES) {
            Err(e) => Err((
                ResourceStatus::Unreadable,
                format!("{meta_file}: {}", io_reason(&e)),
            )),
            Ok(bytes) => match String::from_utf8(bytes) {
                Err(_) => Err((
                    ResourceStatus::Invalid,
                    format!("{meta_file} is not UTF-8 text"),
                )),
                Ok(text) => parse_front_matter(&text)
                    .map_err(|reason| (ResourceStatus::Invalid, format!("{meta_file}: {reason}"))),
            },
        },
    };
    match outcome {
        Ok(front) => {
            resource.body = Some(Body::Skill(v1::Skill {
                dir: dir.display().to_string(),
                name: front.name,
                description: front.description,
            }));
        }
        Err((status, error)) => {
            resource.status = status as i32;
            resource.error = error;
        }
    }
    resource
}

#[derive(Debug, PartialEq, Eq)]
pub struct FrontMatter {
    pub name: String,
    pub description: String,
}

/// Parses the YAML front matter of a skill meta file: a first line `---`, YAML,
/// a closing `---` line; `name` and `description` are required strings.
pub fn parse_front_matter(text: &str) -> Result<FrontMatter, String> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut lines = text.split_inclusive('\n');
    let first = lines.next().unwrap_or("");
    if first.trim_end() != "---" {
        return Err("no YAML front matter (the file must start with a '---' line)".to_owned());
    }
    let mut yaml = String::new();
    let mut closed = false;
    for line in lines {
        if line.trim_end() == "---" || line.trim_end() == "..." {
            closed = true;
            break;
        }
        yaml.push_str(line);
    }
    if !closed {
        return Err("front matter is not closed by a '---' line".to_owned());
    }
    let value: serde_norway::Value = serde_norway::from_str(&yaml)
        .map_err(|e| format!("front matter is not valid YAML: {e}"))?;
    let mapping = value
        .as_mapping()
        .ok_or_else(|| "front matter is not a YAML mapping".to_owned())?;
    let field = |key: &str| -> Result<String, String> {
        match mapping.get(key) {
            None | Some(serde_norway::Value::Null) => Err(format!("front matter has no {key:?}")),
            Some(serde_norway::Value::String(s)) if s.trim().is_empty() => {
                Err(format!("front matter {key:?} is empty"))
            }
            // YAML's "\0" escape is a NUL: cleaned like everything read from disk.
            Some(serde_norway::Value::String(s)) => {
                Ok(ctxsync_mcp::clean_text(s.trim()).trim().to_owned())
            }
            Some(_) => Err(format!("front matter {key:?} is not a string")),
        }
    };
    Ok(FrontMatter {
        name: field("name")?,
        description: field("description")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn config_for(home: &Path, work: &Path, env: &[(&str, &str)]) -> ContextConfig {
        let env: BTreeMap<String, String> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        ContextConfig::resolve(&env, Some(home), Some(work))
    }

    fn content(r: &v1::ContextResource) -> &v1::InstructionFile {
        match &r.body {
            Some(Body::InstructionFile(f)) => f,
            other => panic!("not an instruction file: {other:?}"),
        }
    }

    #[test]
    fn instruction_files_are_read_from_each_dir_and_the_working_dir() {
        let tmp = tempfile::tempdir().unwrap();
        let home = tmp.path().join("home");
        let work = tmp.path().join("work");
        let company = tmp.path().join("company");
        for d in [&home.join(".ctxsync"), &work, &company] {
            fs::create_dir_all(d).unwrap();
        }
        fs::write(home.join(".ctxsync/AGENTS.md"), "home rules").unwrap();
        fs::write(company.join("AGENTS.md"), "company rules").unwrap();
        fs::write(work.join("AGENTS.md"), "repo rules").unwrap();
        let dirs = format!("{},~/.ctxsync", company.display());
        let config = config_for(&home, &work, &[("CTXSYNC_INSTRUCTIONS_DIRS", &dirs)]);
        let files = read_instruction_files(&config);
        let contents: Vec<&str> = files.iter().map(|r| content(r).content.as_str()).collect();
        assert_eq!(contents, ["company rules", "home rules", "repo rules"]);
        assert!(files.iter().all(|r| r.status == ResourceStatus::Ok as i32));
        assert_eq!(
            files[2].source,
            format!("instruction_file:{}", work.join("AGENTS.md").display())
        );
    }

    #[test]
    fn the_same_file_is_never_read_twice() {
        let tmp = tempfile::tempdir().unwrap();
        let work = tmp.path().join("work");
        fs::create_dir_all(&work).unwrap();
        fs::write(work.join("AGENTS.md"), "once").unwrap();
        // The working dir is also an instructions dir, once by path and once through a symlink.
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&work, &link).unwrap();
        let dirs = format!("{},{},.", work.display(), link.display());
        let config = config_for(tmp.path(), &work, &[("CTXSYNC_INSTRUCTIONS_DIRS", &dirs)]);
        let files = read_instruction_files(&config);
        assert_eq!(files.len(), 1, "{files:?}");
        assert_eq!(content(&files[0]).content, "once");
    }

    #[test]
    fn long_files_are_truncated_huge_ones_are_oversize_and_unreadable_ones_say_so() {
        let tmp = tempfile::tempdir().unwrap();
        let dirs: Vec<PathBuf> = ["long", "huge", "noperm", "binary", "isdir"]
            .iter()
            .map(|d| tmp.path().join(d))
            .collect();
        for d in &dirs {
            fs::create_dir_all(d).unwrap();
        }
        fs::write(dirs[0].join("AGENTS.md"), "é".repeat(40 * 1024)).unwrap();
        fs::write(
            dirs[1].join("AGENTS.md"),
            vec![b'a'; MAX_INSTRUCTION_FILE_BYTES as usize + 1],
        )
        .unwrap();
        let noperm = dirs[2].join("AGENTS.md");
        fs::write(&noperm, "secret").unwrap();
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&noperm, fs::Permissions::from_mode(0o000)).unwrap();
        fs::write(dirs[3].join("AGENTS.md"), [0xff, 0xfe, 0x00]).unwrap();
        fs::create_dir_all(dirs[4].join("AGENTS.md")).unwrap();
        let list = dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(",");
        let config = config_for(
            tmp.path(),
            tmp.path(),
            &[("CTXSYNC_INSTRUCTIONS_DIRS", &list)],
        );
        let files = read_instruction_files(&config);
        assert_eq!(files.len(), 5, "{files:?}");

        let long = content(&files[0]);
        assert!(long.truncated);
        assert!(long.content.len() <= MAX_INSTRUCTION_CONTENT_BYTES);
        assert!(long.content.len() > MAX_INSTRUCTION_CONTENT_BYTES - 4);
        assert_eq!(files[0].status, ResourceStatus::Ok as i32);

        assert_eq!(files[1].status, ResourceStatus::Oversize as i32);
        assert!(content(&files[1]).content.is_empty());
        assert!(
            files[1].error.contains("1048576-byte limit"),
            "{}",
            files[1].error
        );

        // Root reads any file regardless of mode bits; only assert when the mode bits bite.
        if fs::read(&noperm).is_err() {
            assert_eq!(files[2].status, ResourceStatus::Unreadable as i32);
            assert_eq!(files[2].error, "permission denied");
        }
        assert_eq!(files[3].status, ResourceStatus::Invalid as i32);
        assert_eq!(files[4].status, ResourceStatus::Unreadable as i32);
    }

    #[test]
    fn nul_and_control_characters_in_files_are_cleaned_when_read() {
        let tmp = tempfile::tempdir().unwrap();
        let work = tmp.path().join("work");
        fs::create_dir_all(&work).unwrap();
        fs::write(
            work.join("AGENTS.md"),
            "rules\0\r\n\u{1b}[1mbold\u{1b}[0m\tok\n",
        )
        .unwrap();
        let config = config_for(tmp.path(), &work, &[]);
        let files = read_instruction_files(&config);
        assert_eq!(content(&files[0]).content, "rules\u{fffd}\nbold\tok\n");
        // YAML's "\0" and "\e" escapes.
        let front =
            parse_front_matter("---\nname: \"p\\0df\"\ndescription: \"\\e[1mWork\\0\"\n---\n")
                .unwrap();
        assert_eq!(front.name, "p\u{fffd}df");
        assert_eq!(front.description, "Work\u{fffd}");
    }

    #[test]
    fn front_matter_gives_name_and_description() {
        let front = parse_front_matter(
            "---\nname: pdf\ndescription: Work with PDF files\nextra: 1\n---\n# Body\n",
        )
        .unwrap();
        assert_eq!(
            front,
            FrontMatter {
                name: "pdf".into(),
                description: "Work with PDF files".into()
            }
        );
    }

    #[test]
    fn missing_or_malformed_front_matter_is_reported_with_the_reason() {
        let cases = [
            ("# no front matter\n", "no YAML front matter"),
            ("---\nname: x\n", "not closed"),
            ("---\nname: [unclosed\n---\n", "not valid YAML"),
            ("---\n- a\n- b\n---\n", "not a YAML mapping"),
            ("---\ndescription: d\n---\n", "no \"name\""),
            ("---\nname: x\n---\n", "no \"description\""),
            (
                "---\nname: x\ndescription: [1]\n---\n",
                "\"description\" is not a string",
            ),
            ("---\nname: ''\ndescription: d\n---\n", "\"name\" is empty"),
        ];
        for (text, reason) in cases {
            let err = parse_front_matter(text).unwrap_err();
            assert!(err.contains(reason), "{text:?}: {err}");
        }
    }

    #[test]
    fn skills_are_found_under_each_skills_dir() {
        let tmp = tempfile::tempdir().unwrap();
        let work = tmp.path().join("work");
        let skills = work.join(".agents/skills");
        let company = tmp.path().join("company-skills");
        let write = |dir: &Path, meta: &str| {
            fs::create_dir_all(dir).unwrap();
            fs::write(dir.join("SKILL.md"), meta).unwrap();
        };
        write(
            &skills.join("pdf"),
            "---\nname: pdf\ndescription: PDFs\n---\n",
        );
        write(&skills.join("broken"), "no front matter");
        write(
            &company.join("pdf"),
            "---\nname: pdf\ndescription: company PDFs\n---\n",
        );
        write(
            &company.join("sql"),
            "---\nname: sql\ndescription: SQL\n---\n",
        );
        fs::create_dir_all(skills.join("not-a-skill")).unwrap();
        fs::write(skills.join("README.md"), "not a dir").unwrap();
        let dirs = format!("{},.agents/skills", company.display());
        let config = config_for(tmp.path(), &work, &[("CTXSYNC_SKILLS_DIRS", &dirs)]);
        let found = read_skills(&config);
        let summary: Vec<(String, i32, String)> = found
            .iter()
            .map(|r| match &r.body {
                Some(Body::Skill(s)) => (s.name.clone(), r.status, s.description.clone()),
                _ => panic!("not a skill"),
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                (
                    "pdf".into(),
                    ResourceStatus::Ok as i32,
                    "company PDFs".into()
                ),
                ("sql".into(), ResourceStatus::Ok as i32, "SQL".into()),
                (String::new(), ResourceStatus::Invalid as i32, String::new()),
                ("pdf".into(), ResourceStatus::Excluded as i32, "PDFs".into()),
            ]
        );
        assert!(found[2].error.contains("no YAML front matter"));
        assert_eq!(
            found[2].source,
            format!("skill:{}", skills.join("broken").display())
        );
        assert!(found[3].warning.contains("found earlier"));
    }

    #[test]
    fn custom_skill_meta_file_name_is_used() {
        let tmp = tempfile::tempdir().unwrap();
        let skills = tmp.path().join("skills");
        fs::create_dir_all(skills.join("a")).unwrap();
        fs::write(
            skills.join("a/META.md"),
            "---\nname: a\ndescription: d\n---\n",
        )
        .unwrap();
        fs::create_dir_all(skills.join("b")).unwrap();
        fs::write(
            skills.join("b/SKILL.md"),
            "---\nname: b\ndescription: d\n---\n",
        )
        .unwrap();
        let dirs = skills.display().to_string();
        let config = config_for(
            tmp.path(),
            tmp.path(),
            &[
                ("CTXSYNC_SKILLS_DIRS", &dirs),
                ("CTXSYNC_SKILL_META_FILE", "META.md"),
            ],
        );
        let found = read_skills(&config);
        assert_eq!(found.len(), 1);
        assert_eq!(
            found[0].source,
            format!("skill:{}", skills.join("a").display())
        );
    }
}

//! The Python client and resume workers under `workers/`, each run by its
//! own pytest suite against this build's approvald binary (`APPROVALD_BIN`),
//! which those suites start as child processes (`approvald serve` on SQLite
//! and `approvald sandbox`) on 127.0.0.1.
//!
//! Each suite gets a venv under `target/worker-venvs/<name>`: made with
//! `python3 -m venv` (or `$APPROVALD_TEST_PYTHON`), then
//! `pip install -r workers/<name>/requirements.txt -e workers/python` when a
//! pinned requirement or the client is missing, and reused as it is
//! otherwise. Without python3, venv, pip or PyPI these tests fail and say
//! why; they never pass silently.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Making a venv and installing a framework (about 4 minutes for the largest
/// on a cold cache; seconds when it is already there).
const SETUP_TIMEOUT: Duration = Duration::from_secs(900);
/// One pytest suite (each takes well under a minute).
const SUITE_TIMEOUT: Duration = Duration::from_secs(600);

/// Prints `0` when every `name==version` line of the requirements file
/// (argv[1]) is installed at that version and `approvald_client` imports
/// from `workers/python/src` (argv[2]); otherwise says what is missing.
const CHECK: &str = r##"
import importlib.metadata as md, pathlib, sys
missing = []
for line in pathlib.Path(sys.argv[1]).read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name, _, version = line.partition("==")
    try:
        have = md.version(name.strip())
    except md.PackageNotFoundError:
        have = None
    if have != version.strip():
        missing.append(f"{line} (have {have})")
try:
    import approvald_client
    src = pathlib.Path(sys.argv[2]).resolve()
    if src not in pathlib.Path(approvald_client.__file__).resolve().parents:
        missing.append(f"approvald_client from {src} (have {approvald_client.__file__})")
except ImportError:
    missing.append("approvald_client")
if sys.version_info < (3, 10):
    missing.append(f"Python >= 3.10 (have {sys.version.split()[0]})")
print("; ".join(missing) or "0")
"##;

struct Ran {
    /// `None` when the process was killed at its timeout.
    status: Option<ExitStatus>,
    output: String,
}

impl Ran {
    fn ok(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }

    fn describe(&self) -> String {
        let status = self.status.map_or_else(|| "killed at its timeout".to_string(), |s| s.to_string());
        format!("{status}\n{}", self.output)
    }
}

/// Runs `cmd` (stdout and stderr together) until it exits or `timeout`
/// passes; then its whole process group is killed, children included.
fn run_bounded(mut cmd: Command, timeout: Duration) -> Result<Ran, String> {
    use std::os::unix::process::CommandExt as _;
    let program = format!("{:?}", cmd.get_program());
    let (mut reader, writer) = std::io::pipe().map_err(|e| format!("pipe: {e}"))?;
    let writer2 = writer.try_clone().map_err(|e| format!("pipe: {e}"))?;
    cmd.stdin(Stdio::null()).stdout(writer).stderr(writer2).process_group(0);
    let mut child = cmd.spawn().map_err(|e| format!("cannot start {program}: {e}"))?;
    // Drop our copies of the write end (moved into `cmd`) so the reader ends with the child.
    drop(cmd);
    let collect = std::thread::spawn(move || {
        let mut out = Vec::new();
        let _ = reader.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| format!("waiting for {program}: {e}"))? {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = Command::new("kill").arg("-KILL").arg(format!("-{}", child.id())).status();
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // A grandchild still holding the pipe would block the reader: bound it too.
    let output = wait_thread(collect, Duration::from_secs(10));
    Ok(Ran { status, output })
}

fn wait_thread(handle: std::thread::JoinHandle<String>, limit: Duration) -> String {
    let deadline = Instant::now() + limit;
    while !handle.is_finished() {
        if Instant::now() >= deadline {
            return "(output not collected: a child process still holds it)".to_string();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    handle.join().unwrap_or_default()
}

fn python_command(python: &Path) -> Command {
    let mut cmd = Command::new(python);
    for var in ["PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV"] {
        cmd.env_remove(var);
    }
    cmd.env("PYTHONDONTWRITEBYTECODE", "1").env("PYTHONUNBUFFERED", "1").env("PYTHONIOENCODING", "utf-8");
    cmd
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `target/worker-venvs/<name>` (the target dir is the parent of `CARGO_TARGET_TMPDIR`).
fn venv_dir(name: &str) -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent().unwrap_or(tmp).join("worker-venvs").join(name)
}

/// What the venv lacks, or `None` when it has every pinned requirement.
fn missing(python: &Path, requirements: &Path) -> Option<String> {
    if !python.exists() {
        return Some("no venv".to_string());
    }
    let mut cmd = python_command(python);
    cmd.arg("-c").arg(CHECK).arg(requirements).arg(repo().join("workers/python/src"));
    match run_bounded(cmd, Duration::from_secs(60)) {
        Ok(ran) if ran.ok() && ran.output.trim() == "0" => None,
        Ok(ran) => Some(ran.describe()),
        Err(e) => Some(e),
    }
}

/// The venv's Python for worker `name`, made or completed if needed.
fn ensure_venv(name: &str) -> PathBuf {
    let dir = venv_dir(name);
    let python = dir.join("bin").join("python");
    let requirements = repo().join("workers").join(name).join("requirements.txt");
    assert!(requirements.exists(), "{} is missing", requirements.display());
    // One test process at a time prepares a venv (`cargo test` runs may overlap).
    std::fs::create_dir_all(dir.parent().expect("a parent")).expect("create target/worker-venvs");
    let lock = std::fs::File::create(dir.with_extension("lock")).expect("create the venv's lock file");
    lock.lock().expect("lock the venv");
    let Some(why) = missing(&python, &requirements) else {
        return python;
    };
    eprintln!("workers::{name}: preparing {} ({})", dir.display(), why.trim());
    let started = Instant::now();
    if !python.exists() {
        let host = std::env::var("APPROVALD_TEST_PYTHON").unwrap_or_else(|_| "python3".to_string());
        let mut venv = Command::new(&host);
        venv.arg("-m").arg("venv").arg("--clear").arg(&dir);
        let made = run_bounded(venv, SETUP_TIMEOUT).unwrap_or_else(|e| {
            panic!(
                "workers::{name}: {e}\nThe worker tests need python3 (>= 3.10) with venv and pip \
                 (Debian: apt-get install python3-venv), or APPROVALD_TEST_PYTHON"
            )
        });
        assert!(made.ok(), "workers::{name}: `{host} -m venv {}` failed: {}", dir.display(), made.describe());
    }
    let mut pip = python_command(&python);
    pip.args(["-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--quiet", "-r"])
        .arg(&requirements)
        .arg("-e")
        .arg(repo().join("workers/python"));
    let installed = run_bounded(pip, SETUP_TIMEOUT).unwrap_or_else(|e| panic!("workers::{name}: pip: {e}"));
    assert!(
        installed.ok(),
        "workers::{name}: pip could not install {} (PyPI is needed): {}",
        requirements.display(),
        installed.describe()
    );
    if let Some(still) = missing(&python, &requirements) {
        panic!("workers::{name}: after pip install the venv still lacks: {still}");
    }
    eprintln!("workers::{name}: venv ready in {:.0?}", started.elapsed());
    python
}

/// Runs `workers/<name>`'s pytest suite; fails with its output if it fails.
fn run_suite(name: &str) {
    let python = ensure_venv(name);
    let mut cmd = python_command(&python);
    cmd.current_dir(repo().join("workers").join(name))
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "tests"])
        .env("APPROVALD_BIN", env!("CARGO_BIN_EXE_approvald"));
    let started = Instant::now();
    let ran = run_bounded(cmd, SUITE_TIMEOUT).unwrap_or_else(|e| panic!("workers::{name}: pytest: {e}"));
    assert!(ran.ok(), "workers::{name}: pytest failed: {}", ran.describe());
    // A suite that collected nothing exits 5; one that skipped is not a pass either.
    let summary = ran.output.lines().rev().find(|l| l.contains(" passed")).unwrap_or_default().to_string();
    assert!(
        !summary.is_empty() && !summary.contains("skipped"),
        "workers::{name}: pytest ran no test or skipped some: {}",
        ran.describe()
    );
    eprintln!("workers::{name}: {} ({:.0?})", summary.trim(), started.elapsed());
}

#[test]
fn python_client() {
    run_suite("python");
}

#[test]
fn plain_http_example() {
    run_suite("plain_http");
}

#[test]
fn langgraph_worker() {
    run_suite("langgraph");
}

#[test]
fn openai_agents_worker() {
    run_suite("openai_agents");
}

#[test]
fn agent_framework_worker() {
    run_suite("agent_framework");
}

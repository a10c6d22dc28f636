//! Writing to stdout and stderr without panicking.
//!
//! `println!` panics when its stream is gone, so `castor inspect --ir | head -1` would die
//! with a panic, and `castor train ... | head` would lose the run before its checkpoint. Every
//! line the CLI prints goes through [`outln!`](crate::outln) (stdout) or
//! [`errln!`](crate::errln) (stderr) instead: a write that fails marks its stream closed and
//! later writes to it are dropped, so a closed pipe ends the output quietly while the command
//! finishes its work (a training run still saves) and exits as usual.
//!
//! What goes where: stdout carries the result a command was asked for (a summary, a report,
//! the IR, DOT, JSON plan or CUDA listing, generated text, training's step lines); when a
//! command emits a machine-readable result on stdout, everything else it says goes to stderr,
//! as do warnings, the device line and progress bars.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);
static STDERR_CLOSED: AtomicBool = AtomicBool::new(false);

/// Receives each whole line the CLI would print, with its stream, instead of the terminal: a
/// library caller (the Python package) reports them its own way.
pub type Sink = Arc<dyn Fn(Stream, &str) + Send + Sync>;

static SINK: RwLock<Option<Sink>> = RwLock::new(None);
/// Text of a line not yet ended (stdout, stderr), while a sink is set.
static PENDING: Mutex<[String; 2]> = Mutex::new([String::new(), String::new()]);

/// Sends every line to `sink` from now on (`None`: to the terminal again).
pub fn redirect(sink: Option<Sink>) {
    if let Ok(mut s) = SINK.write() {
        *s = sink;
    }
}

/// Whether lines go to a sink rather than the terminal (no progress bar is drawn then).
pub fn redirected() -> bool {
    SINK.read().map(|s| s.is_some()).unwrap_or(false)
}

/// Hands `args` to the sink, if one is set, one whole line at a time.
fn to_sink(stream: Stream, args: std::fmt::Arguments) -> bool {
    let Some(sink) = SINK.read().ok().and_then(|s| s.clone()) else {
        return false;
    };
    let lines: Vec<String> = {
        let Ok(mut pending) = PENDING.lock() else {
            return true;
        };
        let buffer = &mut pending[stream as usize];
        buffer.push_str(&args.to_string());
        let Some(end) = buffer.rfind('\n') else {
            return true;
        };
        let whole: String = buffer.drain(..=end).collect();
        whole.lines().map(str::to_string).collect()
    };
    for line in &lines {
        sink(stream, line);
    }
    true
}

/// Writes to stdout; a failed write (a closed pipe) closes it for the rest of the run.
pub fn stdout(args: std::fmt::Arguments) {
    if to_sink(Stream::Stdout, args) || STDOUT_CLOSED.load(Ordering::Relaxed) {
        return;
    }
    let mut lock = std::io::stdout().lock();
    if lock.write_fmt(args).and_then(|()| lock.flush()).is_err() {
        STDOUT_CLOSED.store(true, Ordering::Relaxed);
    }
}

/// Writes to stderr; a failed write closes it for the rest of the run.
pub fn stderr(args: std::fmt::Arguments) {
    if to_sink(Stream::Stderr, args) || STDERR_CLOSED.load(Ordering::Relaxed) {
        return;
    }
    if std::io::stderr().lock().write_fmt(args).is_err() {
        STDERR_CLOSED.store(true, Ordering::Relaxed);
    }
}

/// True once a write to stdout has failed (its reader went away).
pub fn stdout_closed() -> bool {
    STDOUT_CLOSED.load(Ordering::Relaxed)
}

/// Where a command's report goes: stdout, or stderr when stdout carries an emitted result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    Stdout = 0,
    Stderr = 1,
}

impl Stream {
    pub fn write(self, args: std::fmt::Arguments) {
        match self {
            Stream::Stdout => stdout(args),
            Stream::Stderr => stderr(args),
        }
    }
}

/// `println!` to stdout that never panics (see the module docs).
#[macro_export]
macro_rules! outln {
    () => { $crate::out::stdout(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::out::stdout(format_args!("{}\n", format_args!($($arg)*))) };
}

/// `print!` to stdout that never panics.
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => { $crate::out::stdout(format_args!($($arg)*)) };
}

/// `eprintln!` that never panics.
#[macro_export]
macro_rules! errln {
    () => { $crate::out::stderr(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::out::stderr(format_args!("{}\n", format_args!($($arg)*))) };
}

/// A line to a [`Stream`] chosen at run time.
#[macro_export]
macro_rules! toln {
    ($stream:expr) => { $stream.write(format_args!("\n")) };
    ($stream:expr, $($arg:tt)*) => { $stream.write(format_args!("{}\n", format_args!($($arg)*))) };
}

//! The machinery of the option lists: [`declare_options!`](crate::declare_options), with which
//! every layer declares its options, and what it makes them of ([`OptionDoc`], [`Kind`],
//! [`Reader`], [`Layer`], [`Env`]). The rules every list follows are in the docs of
//! [`crate::options`]; the core's own list is there too.

use crate::error::{Error, Result};

/// The values an option takes.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    /// `0` or `1` (`false`, `true` too, in any case).
    Bool,
    /// A whole number from `min` to `max`, in `unit`.
    Int {
        min: i64,
        max: i64,
        unit: &'static str,
    },
    /// One of these names.
    Enum(&'static [&'static str]),
    /// Any text.
    Text,
    /// A file or directory.
    Path,
    /// A `tracing` filter: a level or directives (`memsaver_allocator=debug,warn`).
    LogFilter,
}

/// Who reads an option, which says what an invalid value does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reader {
    /// libmemsaver.so (allocator, NCCL hook, C ABI): the first operation fails.
    Library,
    /// The Python package: the call that needs it raises `MemsaverError` (or, read at
    /// interpreter start, a warning on stderr).
    Python,
    /// The test suite and the `memsaver` command's fake-driver fallback only.
    Testing,
}

/// One option: a row of docs/options.md.
#[derive(Clone, Copy, Debug)]
pub struct OptionDoc {
    pub env: &'static str,
    /// Other variables read when `env` is not set (torch_memory_saver's, AMem's).
    pub aliases: &'static [&'static str],
    pub kind: Kind,
    /// The default. An entry declared with `default` has one the kind accepts (checked at
    /// compile time), used when the variable is unset or invalid; one declared with `unset`
    /// says in words what its conversion makes of an unset variable.
    pub default: &'static str,
    pub reader: Reader,
    pub doc: &'static str,
}

/// One layer's list, as the registry of every layer (torch-shim's `options`) sees it.
#[derive(Clone, Copy, Debug)]
pub struct Layer {
    /// The heading of its section in docs/options.md.
    pub heading: &'static str,
    /// The paragraph under the heading ("" for none).
    pub intro: &'static str,
    /// Its options, in the order of the documentation.
    pub options: &'static [OptionDoc],
    /// The messages of this process's invalid variables of the list (its `get().errors`).
    pub errors: fn() -> Vec<String>,
    /// Every invalid variable of the list in a lookup: the errors of the options Rust reads,
    /// the log filter's warning, and the Python package's and the tests' options.
    pub validate: fn(Lookup<'_>) -> Vec<String>,
}

/// The variables options are read from: the environment, or a table in tests.
pub type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// Declares one layer's options from one list. In the calling module it defines, for each
/// entry, the [`OptionDoc`] constant `NAME`; the struct of the typed fields, with `errors` (one
/// message per invalid variable), `Default` (no variable set), `from_env`, `from_lookup` and
/// `check` (the error of the first operation while `errors` is not empty) and `check_one` (the
/// same for one entry); `get` (the options of this process, read once) and `checked` (`get`
/// once `check` passes);
/// `OPTIONS` (the entries, in order); `validate`; and `LAYER`, the [`Layer`] for the registry.
///
/// ```text
/// declare_options! {
///     layer "heading in docs/options.md", "paragraph under it, or empty";
///     /// Doc of the struct.
///     pub struct Options {
///         // Fields the list's entries do not make, set by `finish` (they must be `Default`).
///         pub process: Option<(String, Policy)>,
///     }
///     // Optional: cross-option rules, run after the fields are read: fn(&mut Options, &mut Env).
///     finish whole_process_mode;
///     options {
///         /// The doc line of docs/options.md (doc comment lines are joined with spaces).
///         DISK_CHUNK_MB = "MEMSAVER_DISK_CHUNK_MB" | "TMS_DISK_BACKUP_CHUNK_MB",
///             int(1, 65_536, "MiB"), default "64", Library
///             => /// Field docs (optional).
///                pub disk_chunk: usize = |mb| (mb as u64 * MIB) as usize;
///     }
/// }
/// ```
///
/// * KIND: `bool` (value `bool`), `int(min, max, "unit")` (`i64`), `one_of("a", "b")`
///   (`&'static str`), `one_of(Type { A = "a", B = "b" })` (defines the enum `Type`, the
///   value), `path`, `text` (`String`) or `log_filter` (`String`; invalid is a warning).
/// * `default "v"`: the conversion gets the variable's value, or `v` when it is unset or
///   invalid (`v` must be a value of the kind: a compile-time check); `=> pub field: Type;`
///   without a conversion keeps the value as it is.
/// * `unset "words"`: the conversion gets `Option<value>` (`None`: unset or invalid) and the
///   [`Env`] (the other variables), and `words` are the documented default; without a
///   conversion the field is the `Option<value>`.
/// * Without `=> field`, nothing reads the entry here: the Python package's options, the tests',
///   and options that `finish` reads itself.
#[macro_export]
macro_rules! declare_options {
    (
        layer $heading:literal, $intro:literal;
        $(#[$smeta:meta])*
        pub struct $Options:ident {
            $( $(#[$xmeta:meta])* pub $extra:ident : $xty:ty, )*
        }
        $( finish $finish:path; )?
        options {
            $(
                $(#[doc = $doc:literal])+
                $NAME:ident = $env:literal $(| $alias:literal)*,
                    $kind:ident $(($($karg:tt)*))?,
                    $dmode:ident $default:literal,
                    $reader:ident
                    $(=> $(#[$fmeta:meta])* pub $field:ident : $fty:ty $(= $conv:expr)?)?;
            )*
        }
    ) => {
        $(
            $(#[doc = $doc])*
            pub const $NAME: $crate::options::OptionDoc = $crate::options::OptionDoc {
                env: $env,
                aliases: &[$($alias),*],
                kind: $crate::declare_options!(@kind $kind $(($($karg)*))?),
                default: $default,
                reader: $crate::options::Reader::$reader,
                doc: $crate::options::doc_line(concat!($($doc),+)),
            };
            $crate::declare_options!(@default $dmode $NAME);
            $crate::declare_options!(@items $kind $(($($karg)*))?);
        )*

        /// The entries of the list, in the order of the documentation.
        pub const OPTIONS: &[$crate::options::OptionDoc] = &[$($NAME),*];

        /// This list, for the registry of every layer's options.
        pub const LAYER: $crate::options::Layer = $crate::options::Layer {
            heading: $heading,
            intro: $intro,
            options: OPTIONS,
            errors: || get().errors.clone(),
            validate,
        };

        $(#[$smeta])*
        #[derive(Clone, Debug)]
        pub struct $Options {
            $($(
                $(#[$fmeta])*
                #[doc = concat!("\n\nFrom [`", stringify!($NAME), "`] (`", $env, "`).")]
                pub $field: $fty,
            )?)*
            $( $(#[$xmeta])* pub $extra: $xty, )*
            /// One message per invalid variable of the list (the log filter's excepted).
            pub errors: Vec<String>,
        }

        impl Default for $Options {
            /// The defaults (no variable set).
            fn default() -> Self {
                Self::from_lookup(|_| None)
            }
        }

        impl $Options {
            /// The options of this process's environment, read now. Most callers want `get`.
            pub fn from_env() -> Self {
                Self::from_lookup(|name| std::env::var(name).ok())
            }

            /// The options from `get` (the environment, or a table in tests).
            pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Self {
                let mut env = $crate::options::Env::new(&get);
                let mut o = Self::read(&mut env);
                o.errors = env.take_errors();
                o
            }

            /// The options of an environment made of `vars` (tests, tools).
            #[allow(dead_code)]
            pub fn from_vars(vars: &[(&str, &str)]) -> Self {
                Self::from_lookup($crate::options::lookup_in(vars))
            }

            /// The one error the options of `vars` have (tests; panics unless exactly one).
            #[allow(dead_code)]
            pub fn only_error(vars: &[(&str, &str)]) -> String {
                let o = Self::from_vars(vars);
                assert_eq!(o.errors.len(), 1, "{:?}", o.errors);
                o.errors[0].clone()
            }

            /// Reads every entry with a field, then runs `finish`; the messages stay in `env`.
            #[allow(unused_variables)]
            fn read(env: &mut $crate::options::Env<'_>) -> Self {
                $(
                    $crate::declare_options!(
                        @read env, $NAME, $dmode, [$kind $(($($karg)*))?]
                        $(, $field, $fty $(, $conv)?)?
                    );
                )*
                #[allow(unused_mut)]
                let mut o = Self {
                    $($($field,)?)*
                    $($extra: Default::default(),)*
                    errors: Vec::new(),
                };
                $( $finish(&mut o, env); )?
                o
            }

            /// The options of this list must all be valid for an operation to run: the error
            /// names every invalid variable and what it accepts.
            pub fn check(&self) -> $crate::Result<()> {
                $crate::options::check_messages(&self.errors)
            }

            /// [`check`](Self::check) for `option` alone: the error names its variable (or
            /// alias), the value and what it accepts when that one is invalid, whatever the
            /// others are.
            #[allow(dead_code)]
            pub fn check_one(&self, option: &$crate::options::OptionDoc) -> $crate::Result<()> {
                $crate::options::check_messages(
                    self.errors.iter().filter(|e| option.is_named_by(e)),
                )
            }
        }

        /// The options of this process ([`get`]) once every variable of this list is valid,
        /// else the error of `check`: what acts for the application without
        /// `memsaver_allocator::global` (a process that only opens other processes' memory)
        /// checks here, at the first call that uses the options.
        #[allow(dead_code)]
        pub fn checked() -> $crate::Result<&'static $Options> {
            let o = get();
            o.check().map(|()| o)
        }

        /// The options of this process, read from the environment once (on first use).
        pub fn get() -> &'static $Options {
            static READ: std::sync::OnceLock<$Options> = std::sync::OnceLock::new();
            READ.get_or_init($Options::from_env)
        }

        /// Every invalid variable of this list in `get`, one message each: those read here (as
        /// `errors`), the log filter, and the Python package's and the tests'.
        pub fn validate(lookup: $crate::options::Lookup<'_>) -> Vec<String> {
            let mut env = $crate::options::Env::new(lookup);
            let _ = $Options::read(&mut env);
            let mut messages = env.take_errors();
            messages.extend(env.warnings().iter().cloned());
            for o in OPTIONS
                .iter()
                .filter(|o| o.reader != $crate::options::Reader::Library)
            {
                if let Some((var, v)) = env.raw(o)
                    && let Err(e) = o.check(var, &v)
                {
                    messages.push(e);
                }
            }
            messages
        }
    };

    // The kind of an entry.
    (@kind bool) => { $crate::options::Kind::Bool };
    (@kind int($min:expr, $max:expr, $unit:expr)) => {
        $crate::options::Kind::Int { min: $min, max: $max, unit: $unit }
    };
    (@kind one_of($T:ident { $( $(#[$vmeta:meta])* $V:ident = $name:literal ),+ $(,)? })) => {
        $crate::options::Kind::Enum(&[$($name),+])
    };
    (@kind one_of($($name:literal),+ $(,)?)) => { $crate::options::Kind::Enum(&[$($name),+]) };
    (@kind path) => { $crate::options::Kind::Path };
    (@kind text) => { $crate::options::Kind::Text };
    (@kind log_filter) => { $crate::options::Kind::LogFilter };

    // The type of its value.
    (@ty bool) => { bool };
    (@ty int($($arg:tt)*)) => { i64 };
    (@ty one_of($T:ident { $($body:tt)* })) => { $T };
    (@ty one_of($($arg:tt)*)) => { &'static str };
    (@ty path) => { String };
    (@ty text) => { String };
    (@ty log_filter) => { String };

    // Items a kind defines: the enum of `one_of(Type { .. })`.
    (@items one_of($T:ident { $( $(#[$vmeta:meta])* $V:ident = $name:literal ),+ $(,)? })) => {
        #[doc = concat!("The values of an option of kind `one_of(", stringify!($T), ")`.")]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum $T {
            $( $(#[$vmeta])* #[doc = concat!("\n\n`", $name, "`")] $V, )+
        }

        impl $T {
            /// The names, in the order of the variants.
            pub const NAMES: &'static [&'static str] = &[$($name),+];

            /// Its name in the variable.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Self::$V => $name,)+
                }
            }

            /// The variant named `name`.
            pub fn from_name(name: &str) -> Option<Self> {
                match name {
                    $($name => Some(Self::$V),)+
                    _ => None,
                }
            }
        }

        impl $crate::options::FromKind for $T {
            fn from_value(v: $crate::options::Value) -> Option<Self> {
                match v {
                    $crate::options::Value::Name(n) => Self::from_name(n),
                    _ => None,
                }
            }

            fn fallback() -> Self {
                [$(Self::$V),+][0]
            }
        }
    };
    (@items $($kind:tt)*) => {};

    // A typed default must be a value of the kind (an `unset` one is words).
    (@default default $NAME:ident) => {
        const _: () = assert!(
            $NAME.kind.accepts_default($NAME.default),
            concat!("the default of ", stringify!($NAME), " is not a value of its kind")
        );
    };
    (@default unset $NAME:ident) => {};

    // The reading of an entry's field.
    (@read $env:ident, $NAME:ident, default, [$($kind:tt)*], $field:ident, $fty:ty) => {
        $crate::declare_options!(@read $env, $NAME, default, [$($kind)*], $field, $fty, |v| v);
    };
    (@read $env:ident, $NAME:ident, default, [$($kind:tt)*], $field:ident, $fty:ty, $conv:expr) => {
        let $field: $fty = $crate::options::convert(
            $env.read::<$crate::declare_options!(@ty $($kind)*)>(&$NAME)
                .or_else(|| $crate::options::Env::default_of(&$NAME))
                .unwrap_or_else($crate::options::FromKind::fallback),
            $conv,
        );
    };
    (@read $env:ident, $NAME:ident, unset, [$($kind:tt)*], $field:ident, $fty:ty, $conv:expr) => {
        let $field: $fty = {
            let v = $env.read::<$crate::declare_options!(@ty $($kind)*)>(&$NAME);
            $crate::options::convert_unset(v, &*$env, $conv)
        };
    };
    (@read $env:ident, $NAME:ident, unset, [$($kind:tt)*], $field:ident, $fty:ty) => {
        let $field: $fty = $env.read::<$crate::declare_options!(@ty $($kind)*)>(&$NAME);
    };
    (@read $env:ident, $NAME:ident, $dmode:ident, [$($kind:tt)*]) => {};
}

/// A checked value of a variable, of its kind.
#[doc(hidden)]
#[derive(Clone, Debug)]
pub enum Value {
    Bool(bool),
    Int(i64),
    /// One of the names of a [`Kind::Enum`].
    Name(&'static str),
    /// A path, text or log filter.
    Text(String),
}

/// The Rust type of a kind's values (`bool`, `i64`, `&'static str`, `String`, the enums of
/// `one_of(Type { .. })`).
pub trait FromKind: Sized {
    /// The value, when `v` is of this type's kind.
    fn from_value(v: Value) -> Option<Self>;
    /// A value for the impossible case of a default the kind rejects (checked at compile time).
    fn fallback() -> Self;
}

/// `FromKind` for the types of the kinds.
macro_rules! from_kind {
    ($($t:ty: $variant:ident, $fallback:expr;)*) => {$(
        impl FromKind for $t {
            fn from_value(v: Value) -> Option<Self> {
                match v {
                    Value::$variant(x) => Some(x),
                    _ => None,
                }
            }
            fn fallback() -> Self {
                $fallback
            }
        }
    )*};
}

from_kind! {
    bool: Bool, false;
    i64: Int, 0;
    &'static str: Name, "";
    String: Text, String::new();
}

/// Applies the conversion of a `default` entry (a function, so the closure's argument type is
/// known from the value).
#[doc(hidden)]
pub fn convert<T, F>(v: T, conv: impl FnOnce(T) -> F) -> F {
    conv(v)
}

/// Applies the conversion of an `unset` entry.
#[doc(hidden)]
pub fn convert_unset<T, F>(
    v: Option<T>,
    env: &Env<'_>,
    conv: impl FnOnce(Option<T>, &Env<'_>) -> F,
) -> F {
    conv(v, env)
}

/// The doc line of an entry: its doc comment's lines, joined (without the leading space).
#[doc(hidden)]
pub const fn doc_line(joined: &'static str) -> &'static str {
    joined.trim_ascii_start()
}

/// The variables of a lookup, as a list's fields read them, and the messages of the invalid
/// ones: unset and blank are the same; values are trimmed.
pub struct Env<'a> {
    get: Lookup<'a>,
    errors: Vec<String>,
    warnings: Vec<String>,
}

impl<'a> Env<'a> {
    pub fn new(get: Lookup<'a>) -> Self {
        Self {
            get,
            errors: Vec::new(),
            warnings: Vec::new(),
        }
    }

    /// Variable `name`, trimmed; `None` when unset or blank.
    pub fn var(&self, name: &'static str) -> Option<(&'static str, String)> {
        (self.get)(name)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
            .map(|v| (name, v))
    }

    /// The option's variable, else its first alias that is set.
    pub fn raw(&self, o: &OptionDoc) -> Option<(&'static str, String)> {
        std::iter::once(&o.env)
            .chain(o.aliases)
            .find_map(|n| self.var(n))
    }

    /// The option's value: `None` when unset, or invalid (with the message kept: an error, or
    /// for a log filter a warning).
    pub fn read<T: FromKind>(&mut self, o: &OptionDoc) -> Option<T> {
        let (var, v) = self.raw(o)?;
        match o.value(var, &v) {
            Ok(v) => T::from_value(v),
            Err(e) if matches!(o.kind, Kind::LogFilter) => {
                self.warnings.push(e);
                None
            }
            Err(e) => {
                self.errors.push(e);
                None
            }
        }
    }

    /// The option's default as a value of its kind (`None` for an `unset` entry's words).
    pub fn default_of<T: FromKind>(o: &OptionDoc) -> Option<T> {
        o.value(o.env, o.default).ok().and_then(T::from_value)
    }

    /// Keeps the message of an invalid variable (for a list's `finish`).
    pub fn error(&mut self, message: String) {
        self.errors.push(message);
    }

    /// The warnings so far (invalid log filters).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// The errors so far, taken (the generated `from_lookup` and `validate`).
    #[doc(hidden)]
    pub fn take_errors(&mut self) -> Vec<String> {
        std::mem::take(&mut self.errors)
    }
}

/// "a, b or c".
fn or_list(items: &[String]) -> String {
    match items.split_last() {
        None => String::new(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
    }
}

impl Kind {
    /// The accepted values, as messages and the documentation say them.
    pub fn accepted(&self) -> String {
        match self {
            Kind::Bool => "0 or 1".into(),
            Kind::Int { min, max, unit } => {
                let unit = if unit.is_empty() {
                    String::new()
                } else {
                    format!(" ({unit})")
                };
                format!("a whole number from {min} to {max}{unit}")
            }
            Kind::Enum(names) => {
                or_list(&names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            }
            Kind::Text => "any text".into(),
            Kind::Path => "a path".into(),
            Kind::LogFilter => {
                "error, warn, info, debug, trace, off, or directives like memsaver_allocator=debug,warn"
                    .into()
            }
        }
    }

    /// Whether `default` is a value of this kind, at compile time (what [`OptionDoc::check`]
    /// accepts; any text for a log filter, which is checked where it is read).
    pub const fn accepts_default(&self, default: &str) -> bool {
        match self {
            Kind::Bool => {
                const_eq_ignore_case(default, "0")
                    || const_eq_ignore_case(default, "1")
                    || const_eq_ignore_case(default, "false")
                    || const_eq_ignore_case(default, "true")
            }
            Kind::Int { min, max, .. } => match const_parse_i64(default) {
                Some(n) => *min <= n && n <= *max,
                None => false,
            },
            Kind::Enum(names) => {
                let mut i = 0;
                while i < names.len() {
                    if const_eq(names[i], default) {
                        return true;
                    }
                    i += 1;
                }
                false
            }
            Kind::Text | Kind::Path | Kind::LogFilter => true,
        }
    }
}

const fn const_eq(a: &str, b: &str) -> bool {
    const_eq_bytes(a.as_bytes(), b.as_bytes(), false)
}

const fn const_eq_ignore_case(a: &str, b: &str) -> bool {
    const_eq_bytes(a.as_bytes(), b.as_bytes(), true)
}

const fn const_eq_bytes(a: &[u8], b: &[u8], ignore_case: bool) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        let (x, y) = if ignore_case {
            (a[i].to_ascii_lowercase(), b[i].to_ascii_lowercase())
        } else {
            (a[i], b[i])
        };
        if x != y {
            return false;
        }
        i += 1;
    }
    true
}

/// `s.parse::<i64>()`, in a const context.
const fn const_parse_i64(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    let (negative, mut i) = match b {
        [b'-', ..] => (true, 1),
        [b'+', ..] => (false, 1),
        _ => (false, 0),
    };
    if i == b.len() {
        return None;
    }
    let mut n: i64 = 0;
    while i < b.len() {
        if !b[i].is_ascii_digit() {
            return None;
        }
        let d = (b[i] - b'0') as i64;
        let next = match n.checked_mul(10) {
            Some(n) if negative => n.checked_sub(d),
            Some(n) => n.checked_add(d),
            None => None,
        };
        n = match next {
            Some(n) => n,
            None => return None,
        };
        i += 1;
    }
    Some(n)
}

impl OptionDoc {
    /// The message for the invalid `value` of `var` (this option's variable or an alias).
    pub fn invalid(&self, var: &str, value: &str) -> String {
        format!("{var}='{value}': expected {}", self.kind.accepted())
    }

    /// Whether `message` is the one [`invalid`](Self::invalid) makes for this option's
    /// variable or one of its aliases.
    pub fn is_named_by(&self, message: &str) -> bool {
        std::iter::once(&self.env).chain(self.aliases).any(|var| {
            message
                .strip_prefix(var)
                .is_some_and(|rest| rest.starts_with("='"))
        })
    }

    /// Checks `value` of `var` against the kind.
    pub fn check(&self, var: &str, value: &str) -> std::result::Result<(), String> {
        self.value(var, value).map(drop)
    }

    /// `value` of `var` as a value of the kind, or the message that says what it accepts.
    pub fn value(&self, var: &str, value: &str) -> std::result::Result<Value, String> {
        let bad = || self.invalid(var, value);
        match self.kind {
            Kind::Bool => parse_bool(value).map(Value::Bool).ok_or_else(bad),
            Kind::Int { min, max, .. } => match value.parse::<i64>() {
                Ok(n) if (min..=max).contains(&n) => Ok(Value::Int(n)),
                _ => Err(bad()),
            },
            Kind::Enum(names) => names
                .iter()
                .find(|n| **n == value)
                .map(|n| Value::Name(n))
                .ok_or_else(bad),
            Kind::Text | Kind::Path => Ok(Value::Text(value.to_owned())),
            Kind::LogFilter => tracing_subscriber::EnvFilter::try_new(value)
                .map(|_| Value::Text(value.to_owned()))
                .map_err(|e| format!("{} ({e})", bad())),
        }
    }
}

pub(super) fn parse_bool(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" => Some(true),
        "0" | "false" => Some(false),
        _ => None,
    }
}

/// An environment made of `vars` (name, value), for `from_lookup`, `validate` and tests.
pub fn lookup_in(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
    let m: std::collections::HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |n| m.get(n).cloned()
}

/// The error of the first operation while options are invalid: every message of `errors`
/// (those of one list, or of several: `memsaver_allocator::check_options`).
pub fn check_messages<'a>(errors: impl IntoIterator<Item = &'a String>) -> Result<()> {
    let errors: Vec<&str> = errors.into_iter().map(String::as_str).collect();
    if errors.is_empty() {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "invalid memsaver option{}: {} (fix or unset it; docs/options.md lists every option)",
        if errors.len() > 1 { "s" } else { "" },
        errors.join("; ")
    )))
}

impl Layer {
    /// Its section of docs/options.md: the heading, the paragraph, the table.
    pub fn markdown(&self) -> String {
        let mut s = format!("## {}\n\n", self.heading);
        if !self.intro.is_empty() {
            s.push_str(&format!("{}\n\n", self.intro));
        }
        s.push_str("| variable | values | default | meaning |\n| --- | --- | --- | --- |\n");
        for o in self.options {
            let mut var = format!("`{}`", o.env);
            if !o.aliases.is_empty() {
                let aliases: Vec<String> = o.aliases.iter().map(|a| format!("`{a}`")).collect();
                var.push_str(&format!(" (alias {})", aliases.join(", ")));
            }
            let doc = match o.reader {
                Reader::Python => format!("Python package: {}", o.doc),
                _ => o.doc.to_owned(),
            };
            s.push_str(&format!(
                "| {var} | {} | `{}` | {doc} |\n",
                o.kind.accepted(),
                o.default
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::options::lookup_in as lookup;

    /// The macro itself, on a list of every kind.
    mod declared {
        use super::lookup;
        use crate::options::{Env, Kind, Reader};
        use std::path::PathBuf;
        use std::time::Duration;

        declare_options! {
            layer "Sample", "A list of every kind.";

            /// A sample.
            pub struct Sample {
                /// Set by `finish`: `LEVEL` times two.
                pub twice: i64,
            }

            finish finish;

            options {
                /// a bool
                /// on two lines
                SWITCH = "SAMPLE_SWITCH", bool, default "1", Library
                    => pub switch: bool;
                /// a level
                LEVEL = "SAMPLE_LEVEL" | "OLD_LEVEL" | "OLDER_LEVEL", int(-5, 5, ""),
                    default "-2", Library
                    => pub level: i64;
                /// a wait
                WAIT_MS = "SAMPLE_WAIT_MS", int(1, 10, "ms"), default "2", Library
                    => pub wait: Duration = |ms| Duration::from_millis(ms as u64);
                /// a colour
                COLOR = "SAMPLE_COLOR", one_of(Color {
                        /// Red.
                        Red = "red",
                        Blue = "blue",
                    }), default "blue", Library
                    => pub color: Color;
                /// a letter
                LETTER = "SAMPLE_LETTER", one_of("a", "b"), default "a", Library
                    => pub letter: &'static str;
                /// a directory
                DIR = "SAMPLE_DIR", path, unset "(none)", Library
                    => pub dir: Option<PathBuf> = |d, _| d.map(PathBuf::from);
                /// a name, from another variable when unset
                NAME = "SAMPLE_NAME", text, unset "$USER", Library
                    => pub name: String = |n, env| {
                        n.or_else(|| env.var("USER").map(|(_, u)| u)).unwrap_or_default()
                    };
                /// some text
                TEXT = "SAMPLE_TEXT", text, unset "(none)", Library
                    => pub text: Option<String>;
                /// a filter
                FILTER = "SAMPLE_LOG", log_filter, default "warn", Library
                    => pub filter: String;
                /// read by Python
                MODE = "SAMPLE_MODE", one_of("x", "y"), default "x", Python;
            }
        }

        fn finish(o: &mut Sample, env: &mut Env<'_>) {
            o.twice = o.level * 2;
            if o.level > 0 && !o.switch {
                env.error("SAMPLE_LEVEL above 0 needs SAMPLE_SWITCH=1".into());
            }
        }

        fn sample(vars: &[(&str, &str)]) -> Sample {
            Sample::from_lookup(lookup(vars))
        }

        #[test]
        fn the_defaults_are_the_declared_ones() {
            let s = Sample::default();
            assert!(s.switch);
            assert_eq!((s.level, s.twice), (-2, -4));
            assert_eq!(s.wait, Duration::from_millis(2));
            assert_eq!((s.color, s.letter), (Color::Blue, "a"));
            assert_eq!((&s.dir, &s.text), (&None, &None));
            assert_eq!(s.name, "");
            assert_eq!(s.filter, "warn");
            assert!(s.errors.is_empty() && s.check().is_ok());
        }

        #[test]
        fn values_convert_to_their_fields() {
            let s = sample(&[
                ("SAMPLE_SWITCH", " TRUE "),
                ("SAMPLE_LEVEL", "+3"),
                ("SAMPLE_WAIT_MS", "10"),
                ("SAMPLE_COLOR", "red"),
                ("SAMPLE_LETTER", "b"),
                ("SAMPLE_DIR", "/d"),
                ("SAMPLE_TEXT", " two words "),
                ("SAMPLE_LOG", "info"),
                ("USER", "ann"),
            ]);
            assert!(s.errors.is_empty(), "{:?}", s.errors);
            assert!(s.switch);
            assert_eq!((s.level, s.twice), (3, 6));
            assert_eq!(s.wait, Duration::from_millis(10));
            assert_eq!((s.color, s.letter), (Color::Red, "b"));
            assert_eq!(s.dir, Some(PathBuf::from("/d")));
            assert_eq!(s.text.as_deref(), Some("two words"));
            assert_eq!(s.name, "ann", "an unset conversion reads other variables");
            assert_eq!(s.filter, "info");
            assert_eq!(sample(&[("SAMPLE_NAME", "bo")]).name, "bo");
        }

        #[test]
        fn unset_empty_and_blank_are_the_same() {
            for v in ["", " ", "\t"] {
                let s = sample(&[("SAMPLE_SWITCH", v), ("SAMPLE_DIR", v)]);
                assert!(s.errors.is_empty() && s.switch && s.dir.is_none(), "{v:?}");
            }
        }

        #[test]
        fn the_variable_wins_over_its_aliases_and_the_first_alias_over_the_next() {
            let s = sample(&[("OLD_LEVEL", "1"), ("OLDER_LEVEL", "2")]);
            assert_eq!(s.level, 1);
            assert_eq!(sample(&[("OLDER_LEVEL", "2")]).level, 2);
            // Also over an invalid alias value, which is then not read at all.
            let s = sample(&[("SAMPLE_LEVEL", "4"), ("OLD_LEVEL", "loud")]);
            assert_eq!((s.level, s.errors.len()), (4, 0));
            // A blank variable is unset: the alias is read.
            let s = sample(&[("SAMPLE_LEVEL", " "), ("OLD_LEVEL", "-1")]);
            assert_eq!(s.level, -1);
            // An invalid alias is named as itself.
            assert_eq!(
                sample(&[("OLD_LEVEL", "9")]).errors,
                ["OLD_LEVEL='9': expected a whole number from -5 to 5"]
            );
        }

        #[test]
        fn ranges_include_their_ends_only() {
            for (v, ok) in [
                ("-5", true),
                ("5", true),
                ("-6", false),
                ("6", false),
                ("1.5", false),
                ("99999999999999999999", false),
            ] {
                let s = sample(&[("SAMPLE_LEVEL", v)]);
                assert_eq!(s.errors.is_empty(), ok, "{v}: {:?}", s.errors);
            }
            let s = sample(&[("SAMPLE_WAIT_MS", "0")]);
            assert_eq!(
                s.errors,
                ["SAMPLE_WAIT_MS='0': expected a whole number from 1 to 10 (ms)"]
            );
            assert_eq!(s.wait, Duration::from_millis(2), "the default meanwhile");
        }

        #[test]
        fn enums_have_their_names() {
            assert_eq!(Color::NAMES, ["red", "blue"]);
            assert_eq!(Color::Red.name(), "red");
            assert_eq!(Color::from_name("blue"), Some(Color::Blue));
            assert_eq!(Color::from_name("Blue"), None, "names are exact");
            assert!(matches!(COLOR.kind, Kind::Enum(["red", "blue"])));
            let s = sample(&[("SAMPLE_COLOR", "green"), ("SAMPLE_LETTER", "c")]);
            assert_eq!(
                s.errors,
                [
                    "SAMPLE_COLOR='green': expected red or blue",
                    "SAMPLE_LETTER='c': expected a or b",
                ]
            );
            assert_eq!((s.color, s.letter), (Color::Blue, "a"));
            let e = s.check().unwrap_err().to_string();
            assert!(
                e.contains(
                    "invalid memsaver options: SAMPLE_COLOR='green': expected red or \
                     blue; SAMPLE_LETTER='c'"
                ),
                "{e}"
            );
        }

        #[test]
        fn invalid_bools_and_filters() {
            let s = sample(&[("SAMPLE_SWITCH", "yes"), ("SAMPLE_LOG", "a=b=c")]);
            assert_eq!(s.errors, ["SAMPLE_SWITCH='yes': expected 0 or 1"]);
            assert!(s.switch);
            // The filter's is a warning: only validate() reports it.
            assert_eq!(s.filter, "warn");
            let v = validate(&lookup(&[("SAMPLE_LOG", "a=b=c")]));
            assert!(v.len() == 1 && v[0].starts_with("SAMPLE_LOG='a=b=c': expected error"));
        }

        #[test]
        fn one_entry_is_checked_alone_by_its_variable_or_alias() {
            let s = sample(&[("OLDER_LEVEL", "7x"), ("SAMPLE_WAIT_MS", "0")]);
            assert_eq!(s.errors.len(), 2);
            let e = s.check_one(&LEVEL).unwrap_err().to_string();
            assert!(
                e.contains(
                    "invalid memsaver option: OLDER_LEVEL='7x': expected a whole number from -5 to 5"
                ) && !e.contains("SAMPLE_WAIT_MS"),
                "{e}"
            );
            let e = s.check_one(&WAIT_MS).unwrap_err().to_string();
            assert!(
                e.contains("SAMPLE_WAIT_MS='0': expected a whole number from 1 to 10 (ms)")
                    && !e.contains("LEVEL"),
                "{e}"
            );
            assert!(s.check_one(&SWITCH).is_ok() && s.check_one(&COLOR).is_ok());
            // A variable whose name begins with another's is not that one.
            assert!(!SWITCH.is_named_by("SAMPLE_SWITCHES='x': expected 0 or 1"));
            assert!(SWITCH.is_named_by("SAMPLE_SWITCH='x': expected 0 or 1"));
            // A rule of `finish` names no single entry's value.
            let s = sample(&[("SAMPLE_LEVEL", "5"), ("SAMPLE_SWITCH", "0")]);
            assert!(s.check_one(&LEVEL).is_ok() && s.check().is_err());
        }

        #[test]
        fn finish_adds_its_own_errors() {
            let s = sample(&[("SAMPLE_LEVEL", "5"), ("SAMPLE_SWITCH", "0")]);
            assert_eq!((s.level, s.twice), (5, 10));
            assert_eq!(s.errors, ["SAMPLE_LEVEL above 0 needs SAMPLE_SWITCH=1"]);
        }

        #[test]
        fn entries_without_a_field_are_only_validated() {
            let s = sample(&[("SAMPLE_MODE", "z")]);
            assert!(s.errors.is_empty(), "not read by the struct");
            assert_eq!(
                validate(&lookup(&[("SAMPLE_MODE", "z")])),
                ["SAMPLE_MODE='z': expected x or y"]
            );
        }

        #[test]
        fn the_list_makes_its_rows() {
            assert_eq!(OPTIONS.len(), 10);
            assert_eq!(SWITCH.doc, "a bool on two lines");
            assert_eq!(LEVEL.aliases, ["OLD_LEVEL", "OLDER_LEVEL"]);
            assert_eq!((LEVEL.default, DIR.default), ("-2", "(none)"));
            assert_eq!(
                (MODE.reader, SWITCH.reader),
                (Reader::Python, Reader::Library)
            );
            assert_eq!(
                (LAYER.heading, LAYER.intro),
                ("Sample", "A list of every kind.")
            );
            let md = LAYER.markdown();
            assert!(md.starts_with(
                "## Sample\n\nA list of every kind.\n\n| variable | values | default | meaning |\n"
            ));
            assert!(md.contains(
                "| `SAMPLE_LEVEL` (alias `OLD_LEVEL`, `OLDER_LEVEL`) | a whole number \
                 from -5 to 5 | `-2` | a level |\n"
            ));
            assert!(
                md.contains("| `SAMPLE_MODE` | x or y | `x` | Python package: read by Python |\n")
            );
        }
    }

    #[test]
    fn typed_defaults_are_checked_at_compile_time() {
        let int = Kind::Int {
            min: -3,
            max: 100,
            unit: "",
        };
        for (v, ok) in [
            ("0", true),
            ("-0", true),
            ("+7", true),
            ("-3", true),
            ("100", true),
            ("101", false),
            ("-4", false),
            ("", false),
            ("-", false),
            ("1e2", false),
            (" 1", false),
            ("9223372036854775808", false),
        ] {
            assert_eq!(int.accepts_default(v), ok, "{v:?}");
            assert_eq!(
                int.accepts_default(v),
                v.parse::<i64>().is_ok_and(|n| (-3..=100).contains(&n))
            );
        }
        assert!(Kind::Bool.accepts_default("TRUE") && !Kind::Bool.accepts_default("2"));
        assert!(Kind::Enum(&["a", "bc"]).accepts_default("bc"));
        assert!(!Kind::Enum(&["a", "bc"]).accepts_default("b"));
    }
}

//! Errors as log lines: an error and its causes, each said once.
//!
//! Bulwark's error types keep what caused them as their [`source`](std::error::Error::source)
//! and, for the newer ones, leave it out of their own message; whoever logs or prints an
//! error writes [`Chain`] of it so that the line still has the cause.

use std::error::Error;
use std::fmt;
use std::sync::Arc;

/// A source error that a cloneable error type keeps: shared, any type.
pub type SharedError = Arc<dyn Error + Send + Sync>;

/// Writes an error and its causes on one line, `error: cause: cause`. A cause whose text the
/// line already ends with (an error that writes its source into its own message) is not
/// written again.
pub struct Chain<'a>(pub &'a (dyn Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&chain(self.0))
    }
}

/// [`Chain`] as a string.
pub fn chain(error: &(dyn Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let said = cause.to_string();
        if !said.is_empty() && !text.ends_with(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        source = cause.source();
    }
    text
}

/// The first error of type `E` in `error`'s chain, `error` included.
pub fn find_source<'a, E: Error + 'static>(error: &'a (dyn Error + 'static)) -> Option<&'a E> {
    let mut current = Some(error);
    while let Some(e) = current {
        if let Some(found) = e.downcast_ref::<E>() {
            return Some(found);
        }
        current = e.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] Middle);

    #[derive(Debug, thiserror::Error)]
    #[error("middle: {0}")]
    struct Middle(#[source] std::io::Error);

    #[test]
    fn every_cause_is_said_once() {
        let error = Outer(Middle(std::io::Error::other("refused")));
        assert_eq!(chain(&error), "outer: middle: refused");
        assert_eq!(Chain(&error).to_string(), "outer: middle: refused");
        assert!(find_source::<std::io::Error>(&error).is_some());
    }
}

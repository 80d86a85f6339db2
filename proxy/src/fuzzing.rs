//! Entry points for the fuzz targets in `fuzz/` to reach parsers that are private to their
//! stage. Not an API: hidden from the docs, and nothing in Bulwark uses it.

pub use crate::cache::accept::{Encoding, negotiate};
pub use crate::cache::store::{EventType, Kind, Obj, encode_event, event_line};
pub use crate::listen::proxy_header_at_start as proxy_header;

/// The object with its `metadata.resourceVersion` replaced, as a selector watch sends an
/// object that left it (see the cache's store).
pub fn at_version(obj: &Obj, rv: u64) -> bytes::Bytes {
    obj.at_version(rv)
}

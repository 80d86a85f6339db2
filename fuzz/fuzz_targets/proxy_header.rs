//! The start of a connection from a trusted load balancer: a PROXY protocol v1 or v2 header,
//! or the client's own first bytes.
//!
//! Beyond not panicking: a header found is no longer than the bytes read nor than the
//! 4 KiB Bulwark takes, and it is self-delimiting: the same header followed by anything else
//! (the client's TLS bytes) reads the same way.

#![no_main]

use bulwark::fuzzing::proxy_header;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(Some((len, source))) = proxy_header(data) else {
        return;
    };
    assert!(len <= data.len(), "a header longer than its bytes");
    assert!(len <= 4096, "a header past the limit");
    let mut followed = data[..len].to_vec();
    followed.extend_from_slice(&[0x16, 0x03, 0x01, 0x02, 0x00]);
    assert_eq!(
        proxy_header(&followed),
        Ok(Some((len, source))),
        "the header reads differently with TLS bytes after it"
    );
});

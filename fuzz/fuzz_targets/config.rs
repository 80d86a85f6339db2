//! The configuration file: arbitrary bytes as the text of `bulwark serve --config`.
//!
//! Beyond not panicking: a configuration that parsed has no validation problem, and
//! written back out as YAML it parses to the same configuration (so what `/debug/config`
//! style dumps or generated files say is what runs); replica addresses and cached resource
//! names print as text that parses back to themselves.

#![no_main]

use bulwark::config::{Config, GroupResource, ReplicaAddr};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // The small parsers on their own, with the whole input as their text.
    if let Ok(addr) = text.parse::<ReplicaAddr>() {
        assert_eq!(addr.to_string().parse::<ReplicaAddr>(), Ok(addr));
    }
    if let Some(resource) = GroupResource::parse(text) {
        assert_eq!(GroupResource::parse(&resource.to_string()), Some(resource));
    }

    let Ok(config) = text.parse::<Config>() else {
        return;
    };
    assert!(config.validate().is_empty());
    for addr in &config.upstream.replicas {
        assert_eq!(addr.to_string().parse::<ReplicaAddr>().as_ref(), Ok(addr));
    }
    for resource in &config.cache.resources {
        assert_eq!(
            GroupResource::parse(&resource.to_string()).as_ref(),
            Some(resource)
        );
    }
    let written = serde_norway::to_string(&config).expect("a configuration serializes");
    match written.parse::<Config>() {
        Ok(again) => assert_eq!(again, config, "changed when written out:\n{written}"),
        Err(e) => panic!("written out, it does not parse: {e}\n{written}"),
    }
});

//! Unit tests of the cache: the store fed directly, a test double for reviews.

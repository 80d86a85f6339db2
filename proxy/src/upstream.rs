//! The apiserver replicas: connection pool, per-request pick, health, retries (step 8).

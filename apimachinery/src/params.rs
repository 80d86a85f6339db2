//! Query parameter values as apimachinery's parameter codec converts them.

use std::time::Duration;

/// The apiserver's default `--min-request-timeout`: a watch without a timeout of its own
/// lasts a random time in `[this, 2 × this)`.
pub const MIN_REQUEST_TIMEOUT: Duration = Duration::from_secs(1800);

/// A boolean query parameter as `Convert_Slice_string_To_bool` reads the first value of
/// its key: false when the key is absent, `0` or `false` (any case); true for anything
/// else, the empty value included (`?watch` and `?watch=` both watch).
pub fn bool_param(first_value: Option<&str>) -> bool {
    match first_value {
        None => false,
        Some(v) => v != "0" && !v.eq_ignore_ascii_case("false"),
    }
}

/// How long a watch lasts, as the apiserver's `GetTimeoutForWatch` computes it from
/// `timeoutSeconds`: Go's `time.Duration(s) * time.Second`, which wraps like any `int64`
/// product; zero (or no value) is a random time in `[min, 2 × min)`; a negative product is a
/// deadline already past, so the watch ends at once (`Duration::ZERO` here).
pub fn watch_timeout(timeout_seconds: Option<i64>, min_request_timeout: Duration) -> Duration {
    let nanos = timeout_seconds.map_or(0, |s| s.wrapping_mul(1_000_000_000));
    if nanos == 0 && !min_request_timeout.is_zero() {
        return min_request_timeout.mul_f64(rand::random_range(1.0..2.0));
    }
    Duration::from_nanos(u64::try_from(nanos).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{MIN_REQUEST_TIMEOUT, bool_param, watch_timeout};

    #[test]
    fn a_watch_timeout_is_read_as_the_apiserver_reads_it() {
        let min = MIN_REQUEST_TIMEOUT;
        // i64::MIN × 10^9 wraps to exactly 0 in Go, which is "unset" too.
        for unset in [None, Some(0), Some(i64::MIN)] {
            let t = watch_timeout(unset, min);
            assert!(t >= min && t < 2 * min, "{unset:?}: {t:?}");
        }
        assert_eq!(watch_timeout(Some(7), min), Duration::from_secs(7));
        assert_eq!(watch_timeout(Some(-1), min), Duration::ZERO);
        assert_eq!(watch_timeout(Some(-9_223_372_036), min), Duration::ZERO);
        // Go's int64 product wraps: just past 2^63 ns it is negative, past 2^64 small again.
        assert_eq!(watch_timeout(Some(9_223_372_037), min), Duration::ZERO);
        assert_eq!(
            watch_timeout(Some(18_446_744_074), min),
            Duration::from_nanos(290_448_384)
        );
        assert_eq!(
            watch_timeout(Some(9_223_372_036), min),
            Duration::from_nanos(9_223_372_036_000_000_000)
        );
        assert_eq!(watch_timeout(Some(0), Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn only_absent_zero_and_false_are_false() {
        for (value, expected) in [
            (None, false),
            (Some("0"), false),
            (Some("false"), false),
            (Some("FaLsE"), false),
            (Some(""), true),
            (Some("1"), true),
            (Some("true"), true),
            (Some("no"), true),
            (Some("00"), true),
        ] {
            assert_eq!(bool_param(value), expected, "{value:?}");
        }
    }
}

//! Query parameter values as apimachinery's parameter codec converts them.

/// A boolean query parameter as `Convert_Slice_string_To_bool` reads the first value of
/// its key: false when the key is absent, `0` or `false` (any case); true for anything
/// else, the empty value included (`?watch` and `?watch=` both watch).
pub fn bool_param(first_value: Option<&str>) -> bool {
    match first_value {
        None => false,
        Some(v) => v != "0" && !v.eq_ignore_ascii_case("false"),
    }
}

#[cfg(test)]
mod tests {
    use super::bool_param;

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

//! The review endpoints: TokenReview (answered from the static tokens), SubjectAccessReview,
//! SelfSubjectAccessReview (answered by the policy) and SelfSubjectReview.

use http::Response;
use hyper::Request;
use hyper::body::Incoming;
use serde_json::{Value, json};

use crate::api::{need_json, parse_body, read_body, status_response, value_response};
use crate::auth::UserInfo;
use crate::body::SimBody;
use crate::policy::Attributes;
use crate::server::ReplicaInner;
use crate::status::ApiError;
use apimachinery::status::{Cause, Details};

/// One review's logic: request object in, response object out.
pub(crate) type ReviewFn = fn(&ReplicaInner, &UserInfo, Value) -> Result<Value, ApiError>;

/// Reads the review object, answers it with `f`, 201 on success.
pub(crate) async fn review(
    rep: &ReplicaInner,
    user: &UserInfo,
    req: Request<Incoming>,
    f: ReviewFn,
) -> Response<SimBody> {
    let r = async {
        let (h, b) = read_body(req).await?;
        need_json(&h)?;
        let v = parse_body(&h, &b)?;
        f(rep, user, v)
    }
    .await;
    match r {
        Ok(v) => value_response(201, &v),
        Err(e) => status_response(&e),
    }
}

fn review_shell(kind: &str, api_version: &str, spec: Value) -> Value {
    json!({"kind": kind, "apiVersion": api_version, "metadata": {"creationTimestamp": null}, "spec": spec})
}

fn user_json(u: &UserInfo) -> Value {
    let mut v = json!({"username": u.user});
    if !u.uid.is_empty() {
        v["uid"] = json!(u.uid);
    }
    if !u.groups.is_empty() {
        v["groups"] = json!(u.groups);
    }
    if !u.extra.is_empty() {
        v["extra"] = json!(u.extra);
    }
    v
}

pub(crate) fn token_review(rep: &ReplicaInner, _: &UserInfo, v: Value) -> Result<Value, ApiError> {
    let spec = v.get("spec").cloned().unwrap_or(json!({}));
    let token = spec
        .get("token")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let mut out = review_shell("TokenReview", "authentication.k8s.io/v1", spec.clone());
    match rep
        .shared
        .auth
        .tokens
        .iter()
        .find(|t| !token.is_empty() && t.token == token)
    {
        Some(t) => {
            let mut groups = t.groups.clone();
            if !groups.iter().any(|g| g == "system:authenticated") {
                groups.push("system:authenticated".into());
            }
            let u = UserInfo {
                user: t.user.clone(),
                uid: t.uid.clone(),
                groups,
                extra: t.extra.clone(),
            };
            let audiences = spec
                .get("audiences")
                .cloned()
                .unwrap_or(json!(["https://kubernetes.default.svc.cluster.local"]));
            out["status"] =
                json!({"authenticated": true, "user": user_json(&u), "audiences": audiences});
        }
        None => out["status"] = json!({"user": {}}),
    }
    Ok(out)
}

fn sar_attributes(user: &str, groups: Vec<String>, spec: &Value) -> Result<Attributes, ApiError> {
    let s = |v: Option<&Value>, k: &str| {
        v.and_then(|x| x.get(k))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    if let Some(ra) = spec.get("resourceAttributes") {
        Ok(Attributes {
            user: user.to_string(),
            groups,
            verb: s(Some(ra), "verb"),
            resource_request: true,
            group: s(Some(ra), "group"),
            resource: s(Some(ra), "resource"),
            subresource: s(Some(ra), "subresource"),
            namespace: s(Some(ra), "namespace"),
            name: s(Some(ra), "name"),
            path: String::new(),
        })
    } else if let Some(nr) = spec.get("nonResourceAttributes") {
        Ok(Attributes {
            user: user.to_string(),
            groups,
            verb: s(Some(nr), "verb"),
            path: s(Some(nr), "path"),
            ..Default::default()
        })
    } else {
        Err(invalid_review(
            "spec.resourceAttributes",
            "exactly one of nonResourceAttributes or resourceAttributes must be specified",
        ))
    }
}

fn invalid_review(field: &str, detail: &str) -> ApiError {
    ApiError::new(
        422,
        "Invalid",
        format!(
            "SubjectAccessReview.authorization.k8s.io \"\" is invalid: {field}: Invalid value: \"null\": {detail}"
        ),
        Some(Details {
            causes: vec![Cause {
                reason: "FieldValueInvalid".into(),
                message: detail.into(),
                field: field.into(),
            }],
            ..Details::of("", "authorization.k8s.io", "SubjectAccessReview")
        }),
    )
}

fn decide(rep: &ReplicaInner, a: &Attributes) -> Value {
    if rep.shared.policy.allows(a) {
        json!({"allowed": true, "reason": "allowed by bulwark-sim policy"})
    } else {
        json!({"allowed": false})
    }
}

pub(crate) fn subject_access_review(
    rep: &ReplicaInner,
    _: &UserInfo,
    v: Value,
) -> Result<Value, ApiError> {
    let spec = v.get("spec").cloned().unwrap_or(json!({}));
    let user = spec
        .get("user")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let groups: Vec<String> = spec
        .get("groups")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    if user.is_empty() && groups.is_empty() {
        return Err(invalid_review(
            "spec.user",
            "at least one of user or group must be specified",
        ));
    }
    let a = sar_attributes(&user, groups, &spec)?;
    let mut out = review_shell("SubjectAccessReview", "authorization.k8s.io/v1", spec);
    out["status"] = decide(rep, &a);
    Ok(out)
}

pub(crate) fn self_subject_access_review(
    rep: &ReplicaInner,
    u: &UserInfo,
    v: Value,
) -> Result<Value, ApiError> {
    let spec = v.get("spec").cloned().unwrap_or(json!({}));
    let a = sar_attributes(&u.user, u.groups.clone(), &spec)?;
    let mut out = review_shell("SelfSubjectAccessReview", "authorization.k8s.io/v1", spec);
    out["status"] = decide(rep, &a);
    Ok(out)
}

pub(crate) fn self_subject_review(
    _: &ReplicaInner,
    u: &UserInfo,
    _: Value,
) -> Result<Value, ApiError> {
    Ok(json!({
        "kind": "SelfSubjectReview", "apiVersion": "authentication.k8s.io/v1",
        "metadata": {"creationTimestamp": null},
        "status": {"userInfo": user_json(u)}
    }))
}

//! Runs the cases against two apiservers in step and compares their normalized answers.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use rustls::ClientConfig;
use serde_json::Value;

use crate::cases::Case;
use crate::normalize::{self, Shape};

/// An apiserver to ask: its address, and TLS trusting it with an admin's certificate.
pub struct Endpoint {
    pub addr: SocketAddr,
    pub tls: ClientConfig,
}

/// One case's answers from both apiservers.
pub struct Outcome {
    pub id: &'static str,
    pub request: String,
    pub real: Shape,
    pub sim: Shape,
    /// The first difference, if any.
    pub difference: Option<String>,
}

/// Earlier answers of one apiserver, by case id, for the placeholders of later paths.
#[derive(Default)]
struct Answers(HashMap<&'static str, Value>);

impl Answers {
    /// `path` with each `{id:/pointer}` replaced by that value of that earlier answer
    /// (percent-encoded); a missing value becomes `MISSING`.
    fn resolve(&self, path: &str) -> String {
        let mut out = String::new();
        let mut rest = path;
        while let Some(open) = rest.find('{') {
            let Some(close) = rest[open..].find('}') else {
                break;
            };
            out.push_str(&rest[..open]);
            let reference = &rest[open + 1..open + close];
            let value = reference.split_once(':').and_then(|(id, pointer)| {
                self.0
                    .get(id)?
                    .pointer(pointer)?
                    .as_str()
                    .map(str::to_owned)
            });
            let value = value.unwrap_or_else(|| "MISSING".to_owned());
            out.extend(percent_encoding::utf8_percent_encode(
                &value,
                percent_encoding::NON_ALPHANUMERIC,
            ));
            rest = &rest[open + close + 1..];
        }
        out.push_str(rest);
        out
    }
}

/// The normalized answer, and its raw JSON (for later placeholders).
async fn ask(endpoint: &Endpoint, case: &Case, path: &str) -> (Shape, Value) {
    let body = case
        .body
        .as_ref()
        .map(|b| Bytes::from(b.to_string()))
        .unwrap_or_default();
    let mut request = http::Request::builder()
        .method(case.method.clone())
        .uri(format!("https://localhost{path}"))
        .header(
            http::header::ACCEPT,
            case.accept.unwrap_or("application/json"),
        );
    if case.body.is_some() {
        request = request.header(
            http::header::CONTENT_TYPE,
            case.content_type.unwrap_or("application/json"),
        );
    }
    let request = request.body(body).expect("a valid request");
    let answer = tokio::time::timeout(
        Duration::from_secs(20),
        bulwark_sim::client::request(endpoint.addr, &endpoint.tls, request),
    )
    .await;
    match answer {
        Ok(Ok(reply)) => {
            let content_type = reply
                .headers
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok());
            let body = match case.fields {
                Some(fields) => normalize::pick(&reply.body, fields),
                None => reply.body.clone(),
            };
            let shape = normalize::shape(reply.status, content_type, &body, case.watch);
            (shape, reply.json())
        }
        Ok(Err(e)) => (
            Shape {
                status: 0,
                content_type: String::new(),
                body: normalize::Body::Text(format!("request failed: {e}")),
            },
            Value::Null,
        ),
        Err(_) => (
            Shape {
                status: 0,
                content_type: String::new(),
                body: normalize::Body::Text("no answer within 20 s".into()),
            },
            Value::Null,
        ),
    }
}

/// Sends every case to both apiservers, one at a time and in order.
pub async fn run(real: &Endpoint, sim: &Endpoint, cases: &[Case]) -> Vec<Outcome> {
    let mut answers = [Answers::default(), Answers::default()];
    let mut outcomes = Vec::with_capacity(cases.len());
    for case in cases {
        let mut shapes = Vec::with_capacity(2);
        for (endpoint, answers) in [real, sim].into_iter().zip(answers.iter_mut()) {
            let path = answers.resolve(&case.path);
            let (shape, raw) = ask(endpoint, case, &path).await;
            answers.0.insert(case.id, raw);
            shapes.push(shape);
        }
        let sim_shape = shapes.pop().expect("two answers");
        let real_shape = shapes.pop().expect("two answers");
        outcomes.push(Outcome {
            id: case.id,
            request: format!("{} {}", case.method, case.path),
            difference: normalize::first_difference(&real_shape, &sim_shape),
            real: real_shape,
            sim: sim_shape,
        });
    }
    outcomes
}

/// The suite's result as a Markdown table.
pub fn table(outcomes: &[Outcome]) -> String {
    let mut out =
        String::from("| case | request | real | sim | difference |\n|---|---|---|---|---|\n");
    for o in outcomes {
        out.push_str(&format!(
            "| `{}` | `{}` | {} | {} | {} |\n",
            o.id,
            o.request.replace('|', "\\|"),
            o.real.status,
            o.sim.status,
            o.difference
                .as_deref()
                .unwrap_or("same")
                .replace('|', "\\|")
                .replace('\n', " ")
        ));
    }
    out
}

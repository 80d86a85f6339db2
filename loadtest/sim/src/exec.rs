//! Long-running pod subresources: `pods/exec` as an HTTP/1.1 Upgrade that echoes (raw for a
//! generic upgrade, the `v5.channel.k8s.io` WebSocket protocol kubectl speaks), and
//! `pods/log?follow=true` streaming lines.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use http::{HeaderValue, Response, StatusCode, header};
use hyper::Request;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role};
use tokio_util::sync::CancellationToken;

use crate::api::{Query, RequestInfo, param, status_response, text};
use crate::body::SimBody;
use crate::discovery;
use crate::server::ReplicaInner;
use crate::status::{self, ApiError};

/// WebSocket subprotocols of the exec channel protocol, newest first.
const WS_PROTOCOLS: &[&str] = &["v5.channel.k8s.io", "v4.channel.k8s.io"];

fn pod_exists(rep: &ReplicaInner, ri: &RequestInfo) -> Result<(), ApiError> {
    match rep.shared.store.get_obj("pods", &ri.namespace, &ri.name) {
        Some(_) => Ok(()),
        None => Err(status::not_found("pods", "", &ri.name)),
    }
}

/// `pods/NAME/exec`: upgrades and echoes stdin to stdout until the client closes.
pub async fn exec(
    rep: &Arc<ReplicaInner>,
    ri: &RequestInfo,
    mut req: Request<Incoming>,
    cancel: CancellationToken,
) -> Response<SimBody> {
    if let Err(e) = pod_exists(rep, ri) {
        return status_response(&e);
    }
    let upgrade = req
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let Some(upgrade) = upgrade else {
        return status_response(&status::bad_request("Upgrade request required".into()));
    };
    let websocket = upgrade.eq_ignore_ascii_case("websocket");
    let mut resp = Response::new(SimBody::empty());
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = resp.headers_mut();
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    let mut protocol = None;
    if websocket {
        let Some(key) = req.headers().get(header::SEC_WEBSOCKET_KEY) else {
            return status_response(&status::bad_request("missing Sec-WebSocket-Key".into()));
        };
        let offered: Vec<String> = req
            .headers()
            .get_all(header::SEC_WEBSOCKET_PROTOCOL)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|s| s.split(',').map(|p| p.trim().to_string()))
            .collect();
        protocol = WS_PROTOCOLS
            .iter()
            .find(|p| offered.iter().any(|o| o == *p))
            .copied();
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        if let Ok(v) = HeaderValue::from_str(&derive_accept_key(key.as_bytes())) {
            h.insert(header::SEC_WEBSOCKET_ACCEPT, v);
        }
        if let Some(p) = protocol {
            h.insert(header::SEC_WEBSOCKET_PROTOCOL, HeaderValue::from_static(p));
        }
    } else if let Ok(v) = HeaderValue::from_str(&upgrade) {
        h.insert(header::UPGRADE, v);
    }
    let on_upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        let io = match on_upgrade.await {
            Ok(u) => TokioIo::new(u),
            Err(e) => {
                tracing::debug!(error = %e, "exec upgrade failed");
                return;
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => {}
            _ = async {
                if websocket {
                    ws_echo(io, protocol).await
                } else {
                    raw_echo(io).await
                }
            } => {}
        }
    });
    resp
}

async fn raw_echo(mut io: TokioIo<hyper::upgrade::Upgraded>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match io.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if io.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// The channel protocol: each binary message starts with a channel byte (0 stdin, 1 stdout,
/// 2 stderr, 3 error/status, 4 resize; v5 adds 255 = close a channel). Stdin is echoed on
/// stdout; when stdin closes the command "exits" with a Success status on channel 3.
async fn ws_echo(io: TokioIo<hyper::upgrade::Upgraded>, protocol: Option<&str>) {
    let mut ws = WebSocketStream::from_raw_socket(io, Role::Server, None).await;
    let v5 = protocol == Some("v5.channel.k8s.io");
    while let Some(msg) = ws.next().await {
        let data: Bytes = match msg {
            Ok(Message::Binary(b)) => b,
            Ok(Message::Close(_)) | Err(_) => return,
            Ok(_) => continue,
        };
        match data.first() {
            Some(0) => {
                let mut out = Vec::with_capacity(data.len());
                out.push(1u8);
                out.extend_from_slice(&data[1..]);
                if ws.send(Message::Binary(out.into())).await.is_err() {
                    return;
                }
            }
            Some(255) if v5 && data.get(1) == Some(&0) => break,
            _ => {}
        }
    }
    let mut status = vec![3u8];
    status.extend_from_slice(br#"{"metadata":{},"status":"Success"}"#);
    let _ = ws.send(Message::Binary(status.into())).await;
    let _ = ws
        .close(Some(CloseFrame {
            code: CloseCode::Normal,
            reason: "".into(),
        }))
        .await;
}

/// `pods/NAME/log`: a few lines, or with `follow=true` a line every 100 ms until the client
/// goes away.
pub async fn logs(rep: &Arc<ReplicaInner>, ri: &RequestInfo, q: &Query) -> Response<SimBody> {
    if let Err(e) = pod_exists(rep, ri) {
        return status_response(&e);
    }
    let _ = discovery::by_key("pods");
    let follow = apimachinery::params::bool_param(param(q, "follow"));
    let pod = ri.name.clone();
    if !follow {
        return text(
            200,
            &(0..3)
                .map(|i| format!("{pod} log line {i}\n"))
                .collect::<String>(),
        );
    }
    let s = futures::stream::unfold(0u64, move |i| {
        let pod = pod.clone();
        async move {
            if i > 0 {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Some((Bytes::from(format!("{pod} log line {i}\n")), i + 1))
        }
    });
    let mut r = Response::new(SimBody::stream(s));
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    r
}

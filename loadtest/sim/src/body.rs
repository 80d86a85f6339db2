//! The response body type of every reply: pre-encoded chunks or a stream of them, with
//! resources (heap charges, in-flight counts) held until the body is done, and the
//! mid-body reset fault.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::Stream;
use futures::stream::BoxStream;
use http_body::{Body, Frame, SizeHint};

/// Error that ends a body early (the mid-body reset fault).
#[derive(Debug, thiserror::Error)]
#[error("injected reset after {0} body bytes")]
pub struct InjectedReset(pub u64);

enum Source {
    Chunks(VecDeque<Bytes>),
    Stream(BoxStream<'static, Bytes>),
}

/// A response body.
pub struct SimBody {
    source: Source,
    remaining: u64,
    sent: u64,
    reset_after: Option<u64>,
    guards: Vec<Box<dyn Send>>,
}

impl std::fmt::Debug for SimBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimBody").field("sent", &self.sent).finish()
    }
}

impl SimBody {
    /// A body of these chunks.
    pub fn chunks(chunks: Vec<Bytes>) -> SimBody {
        let remaining = chunks.iter().map(|c| c.len() as u64).sum();
        SimBody {
            source: Source::Chunks(chunks.into()),
            remaining,
            sent: 0,
            reset_after: None,
            guards: Vec::new(),
        }
    }

    /// A body of one buffer.
    pub fn full(b: impl Into<Bytes>) -> SimBody {
        SimBody::chunks(vec![b.into()])
    }

    /// An empty body.
    pub fn empty() -> SimBody {
        SimBody::chunks(Vec::new())
    }

    /// A streamed body (watch, log follow).
    pub fn stream(s: impl Stream<Item = Bytes> + Send + 'static) -> SimBody {
        SimBody {
            source: Source::Stream(Box::pin(s)),
            remaining: 0,
            sent: 0,
            reset_after: None,
            guards: Vec::new(),
        }
    }

    /// Keeps `g` alive until the body is dropped.
    pub fn hold(mut self, g: impl Send + 'static) -> SimBody {
        self.guards.push(Box::new(g));
        self
    }

    /// Fails the body after this many bytes.
    pub fn reset_after(mut self, n: Option<u64>) -> SimBody {
        self.reset_after = n;
        self
    }

    /// Total length when known up front.
    pub fn known_len(&self) -> Option<u64> {
        match self.source {
            Source::Chunks(_) => Some(self.remaining),
            Source::Stream(_) => None,
        }
    }
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = InjectedReset;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, InjectedReset>>> {
        let this = &mut *self;
        if let Some(n) = this.reset_after
            && this.sent >= n
        {
            this.guards.clear();
            return Poll::Ready(Some(Err(InjectedReset(n))));
        }
        let next = match &mut this.source {
            Source::Chunks(q) => q.pop_front(),
            Source::Stream(s) => match s.as_mut().poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(c) => c,
            },
        };
        let Some(mut chunk) = next else {
            this.guards.clear();
            return Poll::Ready(None);
        };
        if let Some(n) = this.reset_after {
            let room = (n - this.sent) as usize;
            if chunk.len() > room {
                chunk.truncate(room);
            }
        }
        this.sent += chunk.len() as u64;
        this.remaining = this.remaining.saturating_sub(chunk.len() as u64);
        Poll::Ready(Some(Ok(Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        matches!(&self.source, Source::Chunks(q) if q.is_empty()) && self.reset_after.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match self.source {
            Source::Chunks(_) if self.reset_after.is_none() => SizeHint::with_exact(self.remaining),
            _ => SizeHint::default(),
        }
    }
}

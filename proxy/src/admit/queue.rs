//! One priority level: seats, shuffle-sharded fair queues and dispatch by seat-time, after
//! the apiserver's API Priority and Fairness (`fairqueuing/queueset`).
//!
//! A flow hashes to a hand of `handSize` of the level's `queues` and joins the shortest.
//! Each queue carries a virtual start time in seat-seconds; dispatch takes the head of the
//! non-empty queue with the smallest one and charges the queue `seats × expected service
//! time`, corrected to the real seat-time when the request ends. A queue that becomes
//! active starts at the level's virtual time, so idleness earns no credit. A head that
//! needs more seats than are free stops dispatch (a wide request is never starved by
//! narrow ones); a head whose LIST bytes fit on no replica is passed over, and so is every
//! later LIST in that round, so bytes too go out in virtual-time order.
//!
//! Every wait is a oneshot receiver: no lock is held across an await, and a waiter that
//! goes away removes itself (or hands back what it was granted).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use prometheus::{Histogram, IntGauge};
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::Shared;
use super::budget::{ByteBudget, Reservation};
use crate::metrics::Metrics;
use crate::rules::LevelSpec;

/// Expected service time of a request before any has finished in the level.
const INITIAL_SERVICE: f64 = 0.05;

/// Weight of the newest observation in the level's moving average of service time.
const SERVICE_EWMA: f64 = 0.1;

/// One priority level.
pub(crate) struct Level {
    pub(crate) spec: Arc<LevelSpec>,
    /// The spec's name, shared by the refusals that name it.
    pub(crate) name: Arc<str>,
    state: Mutex<State>,
    budget: Arc<dyn ByteBudget>,
    shared: Weak<Shared>,
    /// Replaced by a reload: finishes what it holds, takes nothing new.
    draining: AtomicBool,
    /// A LIST is waiting for bytes: a byte release anywhere re-runs this level's dispatch.
    bytes_blocked: AtomicBool,
    waiting_gauge: IntGauge,
    executing_gauge: IntGauge,
    limit_gauge: IntGauge,
    wait_seconds: Histogram,
}

struct State {
    queues: Vec<Queue>,
    /// The level's virtual time (seat-seconds): the start of the last dispatched request.
    virtual_now: f64,
    executing_seats: u32,
    executing_requests: u32,
    waiting: u32,
    next_id: u64,
    /// Moving average of how long a request holds its seats, seconds.
    service: f64,
    /// Where the search for the smallest virtual start begins, so ties go round.
    rotate: usize,
    /// Seats executing per flow (by flow hash), kept only where `maxSeatsPerFlow` is below
    /// the level's seats; a flow leaves with its last seat.
    by_flow: HashMap<u64, u32>,
}

#[derive(Default)]
struct Queue {
    waiters: VecDeque<Waiter>,
    next_start: f64,
    waiting_seats: u32,
    executing_seats: u32,
}

impl Queue {
    fn load(&self) -> u32 {
        self.waiting_seats + self.executing_seats
    }

    fn active(&self) -> bool {
        !self.waiters.is_empty() || self.executing_seats > 0
    }
}

struct Waiter {
    id: u64,
    flow: u64,
    seats: u32,
    bytes: u64,
    arrived: Instant,
    tx: oneshot::Sender<Grant>,
    /// Passed over at least once because its bytes fit on no replica.
    byte_blocked: bool,
}

/// What a dispatched request holds.
pub(crate) struct Grant {
    pub(crate) seats: SeatGrant,
    pub(crate) bytes: Option<BytesHeld>,
}

/// Seats held in a level until dropped; the drop charges the real seat-time and
/// dispatches what can go next.
pub(crate) struct SeatGrant {
    level: Arc<Level>,
    queue: usize,
    flow: u64,
    seats: u32,
    charged: f64,
    started: Instant,
}

/// LIST bytes held on a replica until dropped; the drop lets waiting LISTs of every level
/// try again.
pub(crate) struct BytesHeld {
    reservation: Option<Reservation>,
    shared: Weak<Shared>,
}

impl BytesHeld {
    pub(crate) fn new(reservation: Reservation, shared: Weak<Shared>) -> Self {
        Self {
            reservation: Some(reservation),
            shared,
        }
    }

    pub(crate) fn replica(&self) -> Option<&str> {
        self.reservation.as_ref().map(|r| r.replica())
    }
}

impl Drop for BytesHeld {
    fn drop(&mut self) {
        drop(self.reservation.take());
        if let Some(shared) = self.shared.upgrade() {
            shared.redispatch_byte_blocked();
        }
    }
}

/// A request's place in a queue. Dropping it before the grant was taken leaves the queue
/// (or hands back the grant).
pub(crate) struct Ticket {
    level: Arc<Level>,
    queue: usize,
    id: u64,
    rx: oneshot::Receiver<Grant>,
    settled: bool,
}

/// Why a wait ended without a grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitEnd {
    /// `maxWait` passed while seats were short.
    Timeout,
    /// `maxWait` passed while the LIST's bytes fit on no replica.
    Bytes,
}

/// The queue is full.
#[derive(Debug)]
pub(crate) struct Full;

/// A level's state for `/debug/levels`.
pub(crate) struct LevelView {
    pub(crate) seats_limit: u32,
    pub(crate) waiting: u32,
    pub(crate) executing_requests: u32,
    pub(crate) executing_seats: u32,
    pub(crate) active_queues: usize,
}

/// Stable 64-bit hash of a flow key (FNV-1a with a final mix), the same on every replica
/// and every run so a flow keeps its hand.
pub(crate) fn flow_hash(key: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    // splitmix64 finalizer: FNV's low bits are weak, and the dealer uses them first.
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// Deals a hand of `hand` distinct queues out of `deck` from `hash`, like the apiserver's
/// shuffle-sharding dealer: mixed-radix digits of the hash, each shifted past the cards
/// already dealt.
pub(crate) fn deal(mut hash: u64, deck: usize, hand: usize) -> Vec<usize> {
    let hand = hand.clamp(1, deck.max(1));
    let mut cards: Vec<usize> = Vec::with_capacity(hand);
    let mut sorted: Vec<usize> = Vec::with_capacity(hand);
    for i in 0..hand {
        let radix = (deck - i) as u64;
        let mut card = (hash % radix) as usize;
        hash /= radix;
        for &taken in &sorted {
            if card >= taken {
                card += 1;
            }
        }
        let at = sorted.partition_point(|&c| c < card);
        sorted.insert(at, card);
        cards.push(card);
    }
    cards
}

impl Level {
    pub(crate) fn new(
        spec: Arc<LevelSpec>,
        budget: Arc<dyn ByteBudget>,
        shared: Weak<Shared>,
        metrics: &Metrics,
    ) -> Arc<Self> {
        let label = [spec.name.as_str()];
        let queues = (0..spec.queues.max(1)).map(|_| Queue::default()).collect();
        let level = Arc::new(Self {
            state: Mutex::new(State {
                queues,
                virtual_now: 0.0,
                executing_seats: 0,
                executing_requests: 0,
                waiting: 0,
                next_id: 0,
                service: INITIAL_SERVICE,
                rotate: 0,
                by_flow: HashMap::new(),
            }),
            budget,
            shared,
            draining: AtomicBool::new(false),
            bytes_blocked: AtomicBool::new(false),
            waiting_gauge: metrics.level_waiting_requests.with_label_values(&label),
            executing_gauge: metrics.level_executing_seats.with_label_values(&label),
            limit_gauge: metrics.level_seats_limit.with_label_values(&label),
            wait_seconds: metrics.queue_wait_seconds.with_label_values(&label),
            name: spec.name.as_str().into(),
            spec,
        });
        level.limit_gauge.set(i64::from(level.seats_limit()));
        level
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Plain counters: after a panic elsewhere they are still worth serving from.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The level's seats now: its configured seats (or its share of the fleet's) times the
    /// share of healthy replicas,
    /// at least one, so a lost replica's load is not poured onto the survivors.
    pub(crate) fn seats_limit(&self) -> u32 {
        let seats = self
            .budget
            .level_seats(&self.spec.name, self.spec.seats.max(1))
            .max(1);
        let (healthy, total) = self.budget.health();
        if total == 0 || healthy >= total {
            return seats;
        }
        let share = (u64::from(seats) * healthy as u64).div_ceil(total as u64);
        u32::try_from(share).unwrap_or(seats).max(1)
    }

    pub(crate) fn set_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Nothing waits or executes.
    pub(crate) fn idle(&self) -> bool {
        let state = self.lock();
        state.waiting == 0 && state.executing_requests == 0
    }

    pub(crate) fn view(&self) -> LevelView {
        let limit = self.seats_limit();
        let state = self.lock();
        LevelView {
            seats_limit: limit,
            waiting: state.waiting,
            executing_requests: state.executing_requests,
            executing_seats: state.executing_seats,
            active_queues: state.queues.iter().filter(|q| q.active()).count(),
        }
    }

    /// The queue of the flow's hand with the least seats waiting and executing.
    fn pick_queue(&self, state: &State, hash: u64) -> usize {
        let hand = deal(hash, state.queues.len(), self.spec.hand_size as usize);
        hand.into_iter()
            .min_by_key(|&q| state.queues[q].load())
            .unwrap_or(0)
    }

    /// Whether a request of the flow would be refused with `queue_full` now (shadow mode
    /// asks without queueing).
    pub(crate) fn would_be_full(&self, hash: u64, seats: u32) -> bool {
        let limit = self.seats_limit();
        let state = self.lock();
        if state.waiting == 0
            && (state.executing_seats == 0 || state.executing_seats + seats <= limit)
        {
            return false;
        }
        let queue = self.pick_queue(&state, hash);
        state.queues[queue].waiters.len() >= self.spec.queue_length as usize
    }

    /// Puts a request in its flow's queue and dispatches what can go.
    pub(crate) fn enqueue(
        self: &Arc<Self>,
        hash: u64,
        seats: u32,
        bytes: u64,
        now: Instant,
    ) -> Result<Ticket, Full> {
        let (tx, rx) = oneshot::channel();
        let mut returned = Vec::new();
        let ticket = {
            let mut state = self.lock();
            let queue = self.pick_queue(&state, hash);
            // With no room to wait, a request still runs if it can run at once.
            let no_room = state.queues[queue].waiters.len() >= self.spec.queue_length as usize;
            if no_room && state.waiting > 0 {
                return Err(Full);
            }
            if !state.queues[queue].active() {
                let virtual_now = state.virtual_now;
                let q = &mut state.queues[queue];
                q.next_start = q.next_start.max(virtual_now);
            }
            let id = state.next_id;
            state.next_id += 1;
            let q = &mut state.queues[queue];
            q.waiting_seats += seats;
            q.waiters.push_back(Waiter {
                id,
                flow: hash,
                seats,
                bytes,
                arrived: now,
                tx,
                byte_blocked: false,
            });
            state.waiting += 1;
            self.waiting_gauge.inc();
            self.dispatch(&mut state, &mut returned);
            if no_room {
                let q = &mut state.queues[queue];
                if let Some(at) = q.waiters.iter().position(|w| w.id == id) {
                    q.waiters.remove(at);
                    q.waiting_seats -= seats;
                    state.waiting -= 1;
                    self.waiting_gauge.dec();
                    drop(state);
                    drop(returned);
                    return Err(Full);
                }
            }
            Ticket {
                level: self.clone(),
                queue,
                id,
                rx,
                settled: false,
            }
        };
        // Grants whose waiter is gone are released only now, outside the lock.
        drop(returned);
        Ok(ticket)
    }

    /// The most seats one flow may hold at once with `limit` seats in force: the level's
    /// `maxSeatsPerFlow`, scaled with the seats when a fleet share or lost replicas shrink
    /// them; `None` where it does not bind.
    fn flow_cap(&self, limit: u32) -> Option<u32> {
        let (cap, seats) = (self.spec.max_seats_per_flow, self.spec.seats);
        if cap == 0 || cap >= seats {
            return None;
        }
        let scaled = (u64::from(cap) * u64::from(limit)).div_ceil(u64::from(seats.max(1)));
        Some(u32::try_from(scaled).unwrap_or(cap).max(1))
    }

    /// Dispatches queued requests while seats (and bytes) allow. Grants that could not be
    /// delivered are pushed to `returned`, to be dropped once the lock is released. A head
    /// whose flow holds its cap of seats already is passed over (the rest of its queue
    /// waits behind it) until one of that flow's requests ends: a flow whose responses
    /// are slow to go out cannot take every seat of its level.
    fn dispatch(self: &Arc<Self>, state: &mut State, returned: &mut Vec<Grant>) {
        let limit = self.seats_limit();
        let flow_cap = self.flow_cap(limit);
        if !self.draining.load(Ordering::Relaxed) {
            // The gauge belongs to the level in force; a draining one shares its label.
            self.limit_gauge.set(i64::from(limit));
        }
        let mut passed_over: Vec<usize> = Vec::new();
        let mut bytes_short = false;
        loop {
            let n = state.queues.len();
            let mut best: Option<usize> = None;
            for k in 0..n {
                let i = (state.rotate + k) % n;
                let q = &state.queues[i];
                if q.waiters.is_empty() || passed_over.contains(&i) {
                    continue;
                }
                if best.is_none_or(|b| q.next_start < state.queues[b].next_start) {
                    best = Some(i);
                }
            }
            let Some(qi) = best else { break };
            let Some(head) = state.queues[qi].waiters.front_mut() else {
                break;
            };
            if let Some(cap) = flow_cap {
                let held = state.by_flow.get(&head.flow).copied().unwrap_or(0);
                if held > 0 && held + head.seats > cap {
                    passed_over.push(qi);
                    continue;
                }
            }
            if state.executing_seats > 0 && state.executing_seats + head.seats > limit {
                break;
            }
            let reservation = if head.bytes > 0 {
                match (!bytes_short)
                    .then(|| self.budget.try_reserve(head.bytes))
                    .flatten()
                {
                    Some(reservation) => Some(reservation),
                    None => {
                        head.byte_blocked = true;
                        bytes_short = true;
                        passed_over.push(qi);
                        continue;
                    }
                }
            } else {
                None
            };
            let Some(waiter) = state.queues[qi].waiters.pop_front() else {
                break;
            };
            let charged = f64::from(waiter.seats) * state.service;
            let q = &mut state.queues[qi];
            q.waiting_seats -= waiter.seats;
            q.executing_seats += waiter.seats;
            state.virtual_now = state.virtual_now.max(q.next_start);
            q.next_start += charged;
            state.waiting -= 1;
            state.executing_seats += waiter.seats;
            state.executing_requests += 1;
            if flow_cap.is_some() {
                *state.by_flow.entry(waiter.flow).or_default() += waiter.seats;
            }
            state.rotate = (qi + 1) % n;
            self.waiting_gauge.dec();
            self.executing_gauge.add(i64::from(waiter.seats));
            let now = Instant::now();
            self.wait_seconds
                .observe(now.saturating_duration_since(waiter.arrived).as_secs_f64());
            let grant = Grant {
                seats: SeatGrant {
                    level: self.clone(),
                    queue: qi,
                    flow: waiter.flow,
                    seats: waiter.seats,
                    charged,
                    started: now,
                },
                bytes: reservation.map(|r| BytesHeld::new(r, self.shared.clone())),
            };
            if let Err(grant) = waiter.tx.send(grant) {
                returned.push(grant);
            }
        }
        self.bytes_blocked.store(bytes_short, Ordering::Relaxed);
    }

    /// Seats executing and waiting, and the LIST bytes waiting: what the level asks of the
    /// fleet.
    pub(crate) fn demand(&self) -> (u64, u64) {
        let state = self.lock();
        let waiting_seats: u64 = state
            .queues
            .iter()
            .map(|q| u64::from(q.waiting_seats))
            .sum();
        let waiting_bytes = state
            .queues
            .iter()
            .flat_map(|q| q.waiters.iter())
            .fold(0u64, |sum, w| sum.saturating_add(w.bytes));
        (
            u64::from(state.executing_seats) + waiting_seats,
            waiting_bytes,
        )
    }

    /// Re-runs dispatch: the seats or bytes the level may use changed.
    pub(crate) fn redispatch(self: &Arc<Self>) {
        let mut returned = Vec::new();
        {
            let mut state = self.lock();
            self.dispatch(&mut state, &mut returned);
        }
        drop(returned);
    }

    /// Re-runs dispatch if a LIST is waiting for bytes.
    pub(crate) fn redispatch_if_byte_blocked(self: &Arc<Self>) {
        if !self.bytes_blocked.load(Ordering::Relaxed) {
            return;
        }
        let mut returned = Vec::new();
        {
            let mut state = self.lock();
            self.dispatch(&mut state, &mut returned);
        }
        drop(returned);
    }

    /// Takes a waiter out of its queue; `Some(byte_blocked)` if it was still there.
    fn remove(self: &Arc<Self>, queue: usize, id: u64) -> Option<bool> {
        let mut returned = Vec::new();
        let removed = {
            let mut state = self.lock();
            let q = &mut state.queues[queue];
            let at = q.waiters.iter().position(|w| w.id == id)?;
            let waiter = q.waiters.remove(at)?;
            q.waiting_seats -= waiter.seats;
            state.waiting -= 1;
            self.waiting_gauge.dec();
            // The head that held dispatch back may be gone.
            self.dispatch(&mut state, &mut returned);
            Some(waiter.byte_blocked)
        };
        drop(returned);
        removed
    }
}

impl Ticket {
    /// Waits for the grant until `deadline`.
    pub(crate) async fn wait(mut self, deadline: Instant) -> Result<Grant, WaitEnd> {
        let outcome = tokio::time::timeout_at(deadline, &mut self.rx).await;
        self.settled = true;
        match outcome {
            Ok(Ok(grant)) => Ok(grant),
            // The level never drops a waiter's sender without sending; treat it as a
            // timeout rather than trust it.
            Ok(Err(_)) => Err(WaitEnd::Timeout),
            Err(_) => match self.level.remove(self.queue, self.id) {
                Some(true) => Err(WaitEnd::Bytes),
                Some(false) => Err(WaitEnd::Timeout),
                // Dispatched at the deadline: the grant is in the channel.
                None => self.rx.try_recv().map_err(|_| WaitEnd::Timeout),
            },
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.settled {
            // The client went away while waiting. A grant already sent is dropped with
            // the receiver, which hands its seats and bytes back.
            self.level.remove(self.queue, self.id);
        }
    }
}

impl Drop for SeatGrant {
    fn drop(&mut self) {
        let held = Instant::now().saturating_duration_since(self.started);
        let mut returned = Vec::new();
        {
            let mut state = self.level.lock();
            let used = f64::from(self.seats) * held.as_secs_f64();
            let q = &mut state.queues[self.queue];
            q.executing_seats -= self.seats;
            // Charge what the request really used instead of the estimate.
            q.next_start += used - self.charged;
            state.executing_seats -= self.seats;
            state.executing_requests -= 1;
            if let Some(held) = state.by_flow.get_mut(&self.flow) {
                *held = held.saturating_sub(self.seats);
                if *held == 0 {
                    state.by_flow.remove(&self.flow);
                }
            }
            state.service += SERVICE_EWMA * (held.as_secs_f64() - state.service);
            self.level.executing_gauge.sub(i64::from(self.seats));
            self.level.dispatch(&mut state, &mut returned);
        }
        drop(returned);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hand_has_distinct_queues_within_the_deck() {
        for key in 0..2000u64 {
            let hand = deal(flow_hash(&key.to_string()), 64, 6);
            assert_eq!(hand.len(), 6);
            let mut sorted = hand.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), 6, "{hand:?}");
            assert!(hand.iter().all(|&q| q < 64));
        }
        assert_eq!(deal(7, 1, 4), vec![0]);
    }

    #[test]
    fn hands_spread_over_the_whole_deck() {
        let mut hits = [0u32; 16];
        for key in 0..16_000u64 {
            hits[deal(flow_hash(&format!("rule/user-{key}")), 16, 1)[0]] += 1;
        }
        assert!(hits.iter().all(|&h| (800..1200).contains(&h)), "{hits:?}");
    }
}

//! Thread-per-core: the node's worker threads, each running a current-thread runtime.
//!
//! A multi-thread (work-stealing) runtime pays for the threads that look for work and
//! for tasks moved between them on every wake-up: on two cores a node spent 1.4–2.2×
//! per check what the same node spends on one thread (bench/RESULTS.md). A worker here
//! is a thread with a current-thread runtime of its own; the node gives each worker its
//! own public and peer listeners (`SO_REUSEPORT`: the kernel spreads connections over
//! them) and a share of the shard actors, so a connection's tasks never leave their
//! thread, and a check whose shard lives on another worker crosses once: into that
//! shard's inbox and back through its answer channel.
//!
//! Worker 0 is the runtime that started the node (`ringlimit serve` runs it on the
//! main thread): the node's other tasks (gossip, the peer link, replication, handoff,
//! the ops face) run there too. Workers 1.. are threads started here; they stop when
//! the [`Workers`] is dropped, after the node's tasks on them have drained.

use std::sync::Arc;
use std::thread::JoinHandle;

use tokio::runtime::{Handle, RuntimeFlavor};
use tokio_util::sync::CancellationToken;

use super::NodeError;

/// The worker runtimes of one node.
pub struct Workers {
    /// One handle per worker; `[0]` is the runtime that started the node.
    handles: Vec<Handle>,
    /// Ends the threads' runtimes.
    stop: CancellationToken,
    threads: Vec<JoinHandle<()>>,
    /// Worker 0's relay, when it has one (a current-thread runtime).
    here: Option<Arc<relay::Relay>>,
}

impl Workers {
    /// Starts `count - 1` worker threads beside the current runtime (`count` 1: none).
    /// Must be called from within a tokio runtime.
    pub fn start(count: usize, node_id: &str) -> Result<Self, NodeError> {
        let stop = CancellationToken::new();
        let mut handles = vec![Handle::current()];
        let mut threads = Vec::new();
        let mut here = None;
        // Worker 0 relays its wakes too when it is one thread (`ringlimit serve`); a
        // multi-thread runtime that started the node (some tests) runs without.
        if count > 1 && Handle::current().runtime_flavor() == RuntimeFlavor::CurrentThread {
            let relay = Arc::new(relay::Relay::default());
            relay::install(relay.clone(), stop.clone());
            here = Some(relay);
        }
        for index in 1..count.max(1) {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| NodeError::Config(format!("starting worker {index}: {e}")))?;
            handles.push(runtime.handle().clone());
            let stop = stop.clone();
            let thread = std::thread::Builder::new()
                .name(format!("{node_id}-w{index}"))
                .spawn(move || {
                    runtime.block_on(async {
                        relay::install(Arc::default(), stop.clone());
                        stop.cancelled().await;
                    });
                    // Dropping the runtime drops what is still on it (nothing, after
                    // a drained shutdown).
                    drop(runtime);
                })
                .map_err(|e| NodeError::Config(format!("starting worker {index}: {e}")))?;
            threads.push(thread);
        }
        Ok(Self {
            handles,
            stop,
            threads,
            here,
        })
    }

    /// Number of workers (at least 1).
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// The runtime of each worker, `[0]` the node's own.
    pub fn handles(&self) -> &[Handle] {
        &self.handles
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(relay) = &self.here {
            relay::uninstall(relay);
        }
        // Not joined: a drop may happen on a runtime thread, which must not block.
        // Each thread ends as soon as its runtime sees the token.
        self.threads.clear();
    }
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workers")
            .field("workers", &self.handles.len())
            .finish()
    }
}

/// Cross-worker wake-ups, batched: what makes a check whose shard is on another worker
/// cost little more than one whose shard is here.
///
/// Tokio wakes a task of a current-thread runtime from another thread by queueing it
/// and writing the runtime's eventfd, once per wake: a shard that answers 20 checks of
/// another worker's connections in one batch makes 20 system calls, and as many
/// wake-ups of that worker. Each worker has a [`Relay`]: a request of the public or
/// peer face ([`RelayWakesLayer`]) is woken through it, so a wake from another thread
/// queues the request's waker there and wakes only the relay's drainer task, once per
/// batch; the drainer, on the request's own thread, wakes each request where it lives
/// (no system call). A wake from the worker's own thread goes straight through.
pub mod relay {
    use std::cell::{Cell, RefCell};
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::task::{Context, Poll, Wake, Waker};

    use futures_util::task::AtomicWaker;
    use tokio_util::sync::CancellationToken;

    thread_local! {
        /// This thread's worker relay, when it runs one.
        static RELAY: RefCell<Option<Arc<Relay>>> = const { RefCell::new(None) };
        /// The address of that relay: a wake compares it to tell local from remote.
        static HERE: Cell<usize> = const { Cell::new(0) };
    }

    /// One worker's queue of wakers woken from other threads.
    #[derive(Default)]
    pub struct Relay {
        queue: Mutex<Vec<Waker>>,
        /// The drainer has been woken and has not drained yet.
        armed: AtomicBool,
        /// The drainer stopped: wakes go straight through.
        closed: AtomicBool,
        drainer: AtomicWaker,
    }

    impl Relay {
        fn is_here(self: &Arc<Self>) -> bool {
            HERE.with(Cell::get) == Arc::as_ptr(self) as usize
        }

        /// Wakes `waker`, a task of this relay's worker: at once from the worker's own
        /// thread, else queued for the drainer.
        fn wake(self: &Arc<Self>, waker: &Waker) {
            if self.is_here() || self.closed.load(Ordering::Acquire) {
                waker.wake_by_ref();
                return;
            }
            self.queue
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(waker.clone());
            if !self.armed.swap(true, Ordering::AcqRel) {
                self.drainer.wake();
            }
            if self.closed.load(Ordering::Acquire) {
                // The drainer stopped while we queued: wake what it left.
                self.drain(&mut Vec::new());
            }
        }

        /// Wakes every queued waker (on the worker's thread: local wakes).
        fn drain(&self, spare: &mut Vec<Waker>) {
            std::mem::swap(
                &mut *self
                    .queue
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
                spare,
            );
            for waker in spare.drain(..) {
                waker.wake();
            }
        }
    }

    /// Makes `relay` this thread's and runs its drainer on the current runtime until
    /// `stop`; call it on the worker's thread, inside its current-thread runtime.
    pub fn install(relay: Arc<Relay>, stop: CancellationToken) {
        HERE.with(|h| h.set(Arc::as_ptr(&relay) as usize));
        RELAY.with(|r| *r.borrow_mut() = Some(relay.clone()));
        tokio::spawn(async move {
            let mut spare = Vec::new();
            let drain = std::future::poll_fn(|cx| {
                relay.drainer.register(cx.waker());
                // Disarm before draining: a waker queued after the swap re-arms and
                // wakes the drainer again.
                relay.armed.store(false, Ordering::Release);
                relay.drain(&mut spare);
                Poll::<()>::Pending
            });
            tokio::select! {
                () = drain => {}
                () = stop.cancelled() => {}
            }
            relay.closed.store(true, Ordering::Release);
            relay.drain(&mut spare);
        });
    }

    /// Forgets this thread's relay if it is `relay` (its worker stopped).
    pub fn uninstall(relay: &Arc<Relay>) {
        if relay.is_here() {
            HERE.with(|h| h.set(0));
            RELAY.with(|r| *r.borrow_mut() = None);
        }
    }

    /// The relay of the thread polling, unless none runs here or it stopped.
    fn current() -> Option<Arc<Relay>> {
        RELAY
            .with(|r| r.borrow().clone())
            .filter(|relay| !relay.closed.load(Ordering::Acquire))
    }

    /// A request's waker, woken through its worker's relay.
    struct Relayed {
        relay: Arc<Relay>,
        inner: Waker,
    }

    impl Wake for Relayed {
        fn wake(self: Arc<Self>) {
            self.relay.wake(&self.inner);
        }

        fn wake_by_ref(self: &Arc<Self>) {
            self.relay.wake(&self.inner);
        }
    }

    /// Wraps every request of a gRPC face so it is woken through its worker's relay.
    /// On a thread without one (a node on one worker) it only polls the request.
    #[derive(Debug, Clone, Copy, Default)]
    pub struct RelayWakesLayer;

    impl<S> tower_layer::Layer<S> for RelayWakesLayer {
        type Service = RelayWakes<S>;

        fn layer(&self, inner: S) -> Self::Service {
            RelayWakes { inner }
        }
    }

    /// The service of [`RelayWakesLayer`].
    #[derive(Debug, Clone)]
    pub struct RelayWakes<S> {
        inner: S,
    }

    impl<S, R> tonic::codegen::Service<R> for RelayWakes<S>
    where
        S: tonic::codegen::Service<R>,
    {
        type Response = S::Response;
        type Error = S::Error;
        type Future = RelayedFuture<S::Future>;

        fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            self.inner.poll_ready(cx)
        }

        fn call(&mut self, request: R) -> Self::Future {
            RelayedFuture {
                inner: self.inner.call(request),
                waker: None,
                looked: false,
            }
        }
    }

    pin_project_lite::pin_project! {
        /// A request's future polled with a waker that goes through the relay of the
        /// worker it runs on (one small allocation per request, on a multi-worker node).
        pub struct RelayedFuture<F> {
            #[pin]
            inner: F,
            // The relayed waker, and the task waker it stands for.
            waker: Option<(Waker, Waker)>,
            looked: bool,
        }
    }

    /// `inner` woken through its worker's relay, like a request of a gRPC face (a framed
    /// peer connection's task, which no tower layer wraps).
    pub fn relayed<F: Future>(inner: F) -> RelayedFuture<F> {
        RelayedFuture {
            inner,
            waker: None,
            looked: false,
        }
    }

    impl<F: Future> Future for RelayedFuture<F> {
        type Output = F::Output;

        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
            let this = self.project();
            if !*this.looked {
                *this.looked = true;
                if let Some(relay) = current() {
                    let inner = cx.waker().clone();
                    let relayed = Waker::from(Arc::new(Relayed {
                        relay,
                        inner: inner.clone(),
                    }));
                    *this.waker = Some((relayed, inner));
                }
            }
            match this.waker {
                None => this.inner.poll(cx),
                Some((relayed, inner)) => {
                    if !inner.will_wake(cx.waker()) {
                        // Polled by another task than the first time (not what hyper
                        // does): from now on, plain wakes.
                        *this.waker = None;
                        return this.inner.poll(cx);
                    }
                    this.inner.poll(&mut Context::from_waker(relayed))
                }
            }
        }
    }
}

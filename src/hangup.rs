//! Whether the client of a request is still there to hear its answer: a leaf of the module
//! graph, so that the lock code (the `optimistic` attempt) can look too.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use rustix::event::{PollFd, PollFlags};

/// Whether the client of a sale is still there to hear its answer. The HTTP handler holds a
/// [`HangupGuard`]: dropped with the handler's future (the client closed its connection, or
/// nginx closed its own after the client left), it marks the sale's client gone. The sale
/// itself runs in a task of its own and is never cut short mid-way: it looks at this only
/// where stopping is clean, once it holds the lock and before it writes, and then sells
/// nothing. A sale nobody waits for would sell stock to nobody (each buyer left, 504 in
/// hand, and may buy again), and queued sales of clients long gone kept selling for the
/// whole wait budget after them.
///
/// hyper drops the handler's future only when it sees the connection end, and it looks only
/// while nothing of the client's is left unread: a client that pipelined a second request,
/// or sent a stray `\r\n` after its body, and then left, was never seen to leave, and its
/// sales landed with nobody to tell. So the sale also asks the socket itself ([`Peer`]).
#[derive(Debug, Clone, Default)]
pub struct Hangup {
    dropped: Option<Arc<AtomicBool>>,
    peer: Option<Peer>,
}

impl Hangup {
    /// A client that never goes away (a sale run from code, not from a request).
    pub fn never() -> Self {
        Self::default()
    }

    /// A hangup to give the sale, and the guard whose drop raises it; `peer` is the
    /// request's connection, when the server put it in the request.
    pub fn watch(peer: Option<Peer>) -> (Self, HangupGuard) {
        let flag = Arc::new(AtomicBool::new(false));
        let hangup = Self {
            dropped: Some(flag.clone()),
            peer,
        };
        (hangup, HangupGuard(flag))
    }

    /// A client known by its connection alone: for a sale run in the request's own task,
    /// which is dropped with the request (no guard needed), but whose client may have left
    /// before its request was even read (an instance that fell behind, or was paused).
    pub fn of_connection(peer: Option<Peer>) -> Self {
        Self {
            dropped: None,
            peer,
        }
    }

    pub fn is_gone(&self) -> bool {
        self.dropped
            .as_ref()
            .is_some_and(|f| f.load(Ordering::Relaxed))
            || self.peer.as_ref().is_some_and(Peer::has_left)
    }
}

/// Held by the request: its drop tells the sale that nobody waits for its answer.
pub struct HangupGuard(Arc<AtomicBool>);

impl Drop for HangupGuard {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A client's connection, as the server accepted it: a copy of its socket, closed when the
/// connection ends ([`Peer::ended`]), so that the copy never keeps a socket open past
/// hyper's own (the client would wait for a close that does not come).
#[derive(Debug, Clone)]
pub struct Peer(Arc<Mutex<Option<OwnedFd>>>);

impl Peer {
    /// `None` when the socket cannot be copied (out of descriptors): the sale then knows of
    /// its client leaving only what hyper sees.
    pub fn of(socket: &impl AsFd) -> Option<Self> {
        let copy = socket.as_fd().try_clone_to_owned().ok()?;
        Some(Self(Arc::new(Mutex::new(Some(copy)))))
    }

    /// The connection is over: its sales' clients are gone.
    pub fn ended(&self) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take();
    }

    /// Whether the client closed its side (`POLLRDHUP`, set even with bytes of its still
    /// unread) or the connection broke. A client that only shut down its sending side might
    /// still read; hyper counts that as gone too, when it sees it (it does not serve half-
    /// closed connections), and so does this.
    pub fn has_left(&self) -> bool {
        let socket = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(socket) = socket.as_ref() else {
            return true;
        };
        let mut fds = [PollFd::new(socket, PollFlags::RDHUP)];
        let zero = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        match rustix::event::poll(&mut fds, Some(&zero)) {
            Ok(0) | Err(_) => false,
            Ok(_) => fds[0]
                .revents()
                .intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{Shutdown, TcpListener, TcpStream};

    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let client = TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (server, _) = listener.accept().expect("accept");
        (client, server)
    }

    #[test]
    fn a_client_that_left_is_seen_even_with_its_bytes_unread() {
        let (mut client, server) = pair();
        let peer = Peer::of(&server).expect("copy");
        let (hangup, _guard) = Hangup::watch(Some(peer.clone()));
        client
            .write_all(b"POST /x HTTP/1.1\r\n\r\n")
            .expect("write");
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!hangup.is_gone(), "unread bytes alone are no hang-up");
        drop(client);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(
            hangup.is_gone(),
            "the close is seen behind the unread bytes"
        );
    }

    #[test]
    fn a_half_close_or_an_ended_connection_is_gone_and_a_quiet_one_is_not() {
        let (client, server) = pair();
        let peer = Peer::of(&server).expect("copy");
        assert!(!peer.has_left());
        client.shutdown(Shutdown::Write).expect("shutdown");
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(peer.has_left());

        let (_client, server) = pair();
        let peer = Peer::of(&server).expect("copy");
        let (hangup, guard) = Hangup::watch(Some(peer.clone()));
        assert!(!hangup.is_gone());
        peer.ended();
        assert!(
            hangup.is_gone(),
            "a connection that ended has no client left"
        );
        drop(guard);
        assert!(hangup.is_gone());
        assert!(!Hangup::never().is_gone());
    }
}

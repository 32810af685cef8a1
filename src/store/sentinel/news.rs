//! What the sentinels' announcements of failovers mean, weighed against what was heard
//! before.
//!
//! Each sentinel announces on its own, when it learns of a change: the leader of a failover
//! at once, the others when its hello messages reach them, which on a busy machine can be a
//! second or more later. So news arrives late and out of order. Taken at its word, a late
//! `+switch-master A B` from a slow sentinel, heard after another sentinel's
//! `+try-failover` of B, once ended the hold on B: the instances went on writing to B while
//! it was being replaced, and lost every sale of those seconds (up to 1891 answered 200 in
//! one run, 1 run in about 20 on a loaded machine). A switch is therefore followed only if
//! it can be the newest news:
//!
//! - not if it names as the new master one whose failover is under way (the failover of B
//!   promotes some other server; a switch *to* B is the story of an earlier failover);
//! - not, within [`SWITCH_PIN`] of following a switch to P, if it neither starts nor ends
//!   at P (a switch from A to B heard after one from B to C, say).
//!
//! And a failover's hold ends with a switch followed, or with the abort of the sentinel
//! that announced it: another sentinel that lost the vote aborts its own attempt while the
//! winner goes on.

use std::fmt;
use std::time::Duration;

use tokio::time::Instant;

/// The longest calls are held for a failover a sentinel announced: one that neither
/// finishes nor says it gave up (its messages lost with a sentinel's connection) stops
/// holding them then.
pub(super) const HOLD_MAX: Duration = Duration::from_secs(5);
/// How long, after following a `+switch-master`, a lookup naming another server, or a
/// switch neither from nor to it, is not followed: a sentinel that has not heard of the
/// switch yet still names the old master, which still says it is one until Sentinel
/// reconfigures it.
pub(super) const SWITCH_PIN: Duration = Duration::from_secs(10);

/// What the sentinels publish about a failover, as far as calls are concerned.
pub(super) const TRY_FAILOVER: &str = "+try-failover";
pub(super) const SWITCH_MASTER: &str = "+switch-master";
pub(super) const ABORTS: [&str; 4] = [
    "-failover-abort-not-elected",
    "-failover-abort-no-good-slave",
    "-failover-abort-slave-timeout",
    "-failover-abort-master-is-not-a-replica",
];

/// A server a sentinel names: where to connect to it. Shown as the `redis` crate writes a
/// TCP address, so that it compares equal to the address of a client of that server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ServerAddr {
    pub(super) host: String,
    pub(super) port: u16,
}

impl ServerAddr {
    fn parse(host: &str, port: &str) -> Option<Self> {
        Some(Self {
            host: host.to_owned(),
            port: port.parse().ok()?,
        })
    }
}

impl fmt::Display for ServerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        redis::ConnectionAddr::Tcp(self.host.clone(), self.port).fmt(f)
    }
}

/// One announcement about our master.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum News {
    /// A sentinel starts a failover of `master`.
    TryFailover { master: ServerAddr },
    /// A sentinel says `to` replaced `from`.
    Switch { from: ServerAddr, to: ServerAddr },
    /// A sentinel gave up its failover of `master`.
    Abort { master: ServerAddr },
}

impl News {
    /// The announcement `payload` on `channel`, if it is about the master named `name`.
    pub(super) fn parse(channel: &str, payload: &str, name: &str) -> Option<Self> {
        let words: Vec<&str> = payload.split_whitespace().collect();
        if channel == SWITCH_MASTER {
            // `<name> <old ip> <old port> <new ip> <new port>`
            let [master, old_ip, old_port, ip, port] = words[..] else {
                return None;
            };
            return (master == name).then_some(Self::Switch {
                from: ServerAddr::parse(old_ip, old_port)?,
                to: ServerAddr::parse(ip, port)?,
            });
        }
        // `master <name> <ip> <port>`: the failover of a master, ours or another's.
        let ["master", master, ip, port, ..] = words[..] else {
            return None;
        };
        if master != name {
            return None;
        }
        let master = ServerAddr::parse(ip, port)?;
        if channel == TRY_FAILOVER {
            Some(Self::TryFailover { master })
        } else if ABORTS.contains(&channel) {
            Some(Self::Abort { master })
        } else {
            None
        }
    }
}

/// What to do about one piece of news.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Act {
    /// Hold calls: a failover started.
    Hold,
    /// Follow this master, and let held calls go.
    Follow(ServerAddr),
    /// Let held calls go to the master followed now: the failover was given up.
    Release,
    /// Nothing: news of an earlier change, or of another sentinel's attempt.
    Ignore,
}

/// What was heard so far.
#[derive(Debug, Default)]
pub(super) struct Heard {
    /// Failovers under way: the sentinel that announced each, the master it replaces, and
    /// until when calls wait for it.
    holds: Vec<(String, ServerAddr, Instant)>,
    /// The master the last followed switch named, and until when nothing else is followed.
    pinned: Option<(ServerAddr, Instant)>,
}

impl Heard {
    /// Takes in `news` from the sentinel at `sentinel`, heard at `now`.
    pub(super) fn hear(&mut self, sentinel: &str, news: News, now: Instant) -> Act {
        self.holds.retain(|(_, _, until)| *until > now);
        match news {
            News::TryFailover { master } => {
                self.holds.retain(|(by, _, _)| by != sentinel);
                self.holds
                    .push((sentinel.to_owned(), master, now + HOLD_MAX));
                Act::Hold
            }
            News::Abort { master } => {
                let before = self.holds.len();
                self.holds
                    .retain(|(by, held, _)| !(by == sentinel && *held == master));
                if self.holds.len() < before && self.holds.is_empty() {
                    Act::Release
                } else {
                    Act::Ignore
                }
            }
            News::Switch { from, to } => {
                let replaced = self.holds.iter().any(|(_, held, _)| *held == to);
                let older = self
                    .pinned_at(now)
                    .is_some_and(|pinned| *pinned != from && *pinned != to);
                if replaced || older {
                    return Act::Ignore;
                }
                self.holds.clear();
                self.pinned = Some((to.clone(), now + SWITCH_PIN));
                Act::Follow(to)
            }
        }
    }

    /// Until when calls wait for a failover under way at `now`, if one is.
    pub(super) fn held_until(&self, now: Instant) -> Option<Instant> {
        self.holds
            .iter()
            .map(|(_, _, until)| *until)
            .filter(|until| *until > now)
            .max()
    }

    /// The master a switch followed within [`SWITCH_PIN`] of `now` named.
    pub(super) fn pinned_at(&self, now: Instant) -> Option<&ServerAddr> {
        self.pinned
            .as_ref()
            .filter(|(_, until)| now < *until)
            .map(|(pinned, _)| pinned)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAME: &str = "inventory";

    fn server(port: u16) -> ServerAddr {
        ServerAddr {
            host: "127.0.0.1".to_owned(),
            port,
        }
    }

    fn switch(from: u16, to: u16) -> News {
        News::Switch {
            from: server(from),
            to: server(to),
        }
    }

    fn try_failover(master: u16) -> News {
        News::TryFailover {
            master: server(master),
        }
    }

    fn abort(master: u16) -> News {
        News::Abort {
            master: server(master),
        }
    }

    fn follow(port: u16) -> Act {
        Act::Follow(server(port))
    }

    #[test]
    fn a_server_shows_as_the_address_of_a_client_of_it() {
        let client = redis::Client::open("redis://127.0.0.1:7001").expect("a valid url");
        assert_eq!(
            server(7001).to_string(),
            client.get_connection_info().addr().to_string()
        );
    }

    #[test]
    fn announcements_about_our_master_are_read_and_others_are_not() {
        assert_eq!(
            News::parse(
                SWITCH_MASTER,
                "inventory 127.0.0.1 7000 127.0.0.1 7001",
                NAME
            ),
            Some(switch(7000, 7001))
        );
        assert_eq!(
            News::parse(TRY_FAILOVER, "master inventory 127.0.0.1 7001", NAME),
            Some(try_failover(7001))
        );
        assert_eq!(
            News::parse(ABORTS[0], "master inventory 127.0.0.1 7001", NAME),
            Some(abort(7001))
        );
        for (channel, payload) in [
            (SWITCH_MASTER, "other 127.0.0.1 7000 127.0.0.1 7001"),
            (SWITCH_MASTER, "inventory 127.0.0.1 7000 127.0.0.1 port"),
            (SWITCH_MASTER, "inventory 127.0.0.1 7000"),
            (TRY_FAILOVER, "master other 127.0.0.1 7001"),
            (
                TRY_FAILOVER,
                "slave 127.0.0.1:7002 127.0.0.1 7002 @ inventory 127.0.0.1 7001",
            ),
            (TRY_FAILOVER, ""),
            ("+sdown", "master inventory 127.0.0.1 7001"),
        ] {
            assert_eq!(
                News::parse(channel, payload, NAME),
                None,
                "{channel} {payload}"
            );
        }
    }

    /// The order of the run that lost 1891 sales: A killed, B promoted, a sentinel that
    /// wrongly thinks B down starts a second failover, and only then does the slowest
    /// sentinel announce the first switch.
    #[test]
    fn a_late_switch_to_the_master_being_replaced_neither_ends_the_hold_nor_moves() {
        let (mut heard, t) = (Heard::default(), Instant::now());
        assert_eq!(heard.hear("s1", try_failover(7000), t), Act::Hold);
        assert_eq!(heard.hear("s1", switch(7000, 7001), t), follow(7001));
        assert_eq!(heard.held_until(t), None);
        assert_eq!(heard.hear("s3", try_failover(7001), t), Act::Hold);
        assert_eq!(heard.hear("s2", switch(7000, 7001), t), Act::Ignore);
        assert!(heard.held_until(t).is_some(), "calls still wait");
        assert_eq!(heard.hear("s3", switch(7001, 7002), t), follow(7002));
        assert_eq!(heard.held_until(t), None);
    }

    #[test]
    fn a_switch_older_than_the_one_followed_is_not_followed_back() {
        let (mut heard, t) = (Heard::default(), Instant::now());
        assert_eq!(heard.hear("s1", switch(7000, 7001), t), follow(7001));
        assert_eq!(heard.hear("s1", switch(7001, 7002), t), follow(7002));
        assert_eq!(heard.hear("s2", switch(7000, 7001), t), Act::Ignore);
        assert_eq!(heard.pinned_at(t), Some(&server(7002)));
        // The same news again from a slower sentinel changes nothing and is harmless.
        assert_eq!(heard.hear("s2", switch(7001, 7002), t), follow(7002));
        // Once the pin has run out, a switch is taken as the news it says it is.
        let later = t + SWITCH_PIN + Duration::from_millis(1);
        assert_eq!(heard.hear("s3", switch(7005, 7006), later), follow(7006));
    }

    #[test]
    fn an_abort_ends_the_hold_of_the_sentinel_that_gave_up_not_of_the_one_going_on() {
        let (mut heard, t) = (Heard::default(), Instant::now());
        assert_eq!(heard.hear("s1", try_failover(7000), t), Act::Hold);
        assert_eq!(heard.hear("s2", try_failover(7000), t), Act::Hold);
        assert_eq!(heard.hear("s2", abort(7000), t), Act::Ignore);
        assert!(heard.held_until(t).is_some(), "s1's failover goes on");
        assert_eq!(
            heard.hear("s3", abort(7000), t),
            Act::Ignore,
            "s3 tried nothing"
        );
        assert_eq!(
            heard.hear("s1", abort(7001), t),
            Act::Ignore,
            "another master"
        );
        assert_eq!(heard.hear("s1", abort(7000), t), Act::Release);
        assert_eq!(heard.held_until(t), None);
    }

    #[test]
    fn a_hold_ends_by_itself_after_its_bound() {
        let (mut heard, t) = (Heard::default(), Instant::now());
        heard.hear("s1", try_failover(7000), t);
        assert_eq!(heard.held_until(t), Some(t + HOLD_MAX));
        assert_eq!(heard.held_until(t + HOLD_MAX), None);
        // A sentinel that announces again extends its own hold, not a second one.
        heard.hear("s1", try_failover(7000), t + Duration::from_secs(1));
        heard.hear("s1", try_failover(7000), t + Duration::from_secs(2));
        assert_eq!(heard.holds.len(), 1);
        assert_eq!(
            heard.held_until(t),
            Some(t + Duration::from_secs(2) + HOLD_MAX)
        );
    }

    /// Whatever order the news of two failovers (A to B, then B to C) arrives in from three
    /// sentinels, once every sentinel has announced both switches the instance follows C,
    /// and it never follows B after it heard B's failover begin.
    #[test]
    fn any_order_of_two_failovers_news_ends_on_the_newest_master_and_never_back() {
        let t = Instant::now();
        // Each sentinel's own messages keep their order; the three interleave freely.
        let own = |s: &'static str, leads: bool| {
            let mut v = vec![(s, switch(7000, 7001))];
            if leads {
                v.insert(0, (s, try_failover(7000)));
                v.push((s, try_failover(7001)));
            }
            v.push((s, switch(7001, 7002)));
            v
        };
        let streams = [own("s1", true), own("s2", false), own("s3", false)];
        let mut orders = 0;
        let mut positions = [0usize; 3];
        interleave(&streams, &mut positions, &mut Vec::new(), &mut |order| {
            orders += 1;
            let mut heard = Heard::default();
            let mut followed = server(7000);
            let mut b_replaced = false;
            for (sentinel, news) in order {
                if *news == try_failover(7001) {
                    b_replaced = true;
                }
                if let Act::Follow(to) = heard.hear(sentinel, news.clone(), t) {
                    assert!(
                        !(b_replaced && to == server(7001)),
                        "followed B during its failover: {order:?}"
                    );
                    followed = to;
                }
            }
            assert_eq!(followed, server(7002), "{order:?}");
        });
        // 8! / (4! 2! 2!) ways to interleave streams of 4, 2 and 2 messages.
        assert_eq!(orders, 420);
    }

    /// One sentinel's message: who said it, and what.
    type Said = (&'static str, News);

    fn interleave<'a>(
        streams: &'a [Vec<Said>; 3],
        positions: &mut [usize; 3],
        order: &mut Vec<&'a Said>,
        check: &mut dyn FnMut(&[&'a Said]),
    ) {
        if (0..3).all(|i| positions[i] == streams[i].len()) {
            let owned: Vec<_> = order.clone();
            check(&owned);
            return;
        }
        for i in 0..3 {
            if positions[i] < streams[i].len() {
                order.push(&streams[i][positions[i]]);
                positions[i] += 1;
                interleave(streams, positions, order, check);
                positions[i] -= 1;
                order.pop();
            }
        }
    }
}

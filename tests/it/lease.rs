//! A renewing holder's lease, for every strategy that renews (one Redis or the quorum's
//! nodes): it never writes once its lease has run out, whatever a renewal still out will
//! say, and a pause of the lock's Redis shorter than the lease costs it nothing. Faults are
//! made with `SIGSTOP` at known moments, under short leases and work longer than them.

use std::time::Duration;

use inventory::lock::Strategy;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use testkit::fixture::{Instance, InstanceBuilder, RedisServer};
use tokio::time::{Instant, sleep_until};

use crate::quorum::{lock_nodes, with_three_nodes};

const TTL_MS: u64 = 1000;

fn renewing(quorum: bool) -> impl Iterator<Item = Strategy> {
    Strategy::ALL
        .into_iter()
        .filter(move |s| s.info().renews && s.info().quorum == quorum)
}

fn signal(servers: &[&RedisServer], signal: Signal) {
    for server in servers {
        let pid = server.pid().expect("a running redis-server");
        kill(Pid::from_raw(pid as i32), signal).unwrap();
    }
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

async fn assert_sales(app: &Instance, sales: i64, what: &str) {
    let audit = app.audit().await;
    assert_eq!(
        (audit["sales"].as_i64(), audit["clean"].as_bool()),
        (Some(sales), Some(true)),
        "{what}: {audit}"
    );
}

/// The renewal sent a third of the lease in meets a frozen Redis and waits for its answer
/// (`REDIS_TIMEOUT_MS` as long as the lease) past the lease's end; the holder's work ends
/// after that. It used to count time only once a renewal had failed, and wrote. Also for a
/// lock handed over by a release, whose lease, with a TTL no longer than the handed one,
/// used to count from the start of the wait (already over before its first renewal).
#[tokio::test(flavor = "multi_thread")]
async fn a_holder_whose_renewal_is_still_unanswered_never_writes_past_its_lease() {
    let redis = RedisServer::start().await;
    let start = |name: &str| {
        InstanceBuilder::new(&redis, name)
            .env("LOCK_TTL_MS", TTL_MS)
            .env("REDIS_TIMEOUT_MS", TTL_MS)
            .start()
    };
    let (holder, other) = (start("app1").await, start("app2").await);
    for strategy in renewing(false) {
        for handed in [false, true] {
            let what = format!("{strategy}, handed over: {handed}");
            holder.reset(5).await;
            let began = Instant::now();
            // Handed over: the other instance holds first and the holder queues behind it.
            let (first_ms, holder_at, freeze_at) =
                if handed { (800, 100, 900) } else { (0, 0, 150) };
            let work = TTL_MS * 12 / 10;
            let thaw_at = holder_at + first_ms + work + 50;
            let first = async {
                if handed {
                    Some(
                        other
                            .sale(&format!("strategy={strategy}&work_ms={first_ms}"))
                            .await,
                    )
                } else {
                    None
                }
            };
            let held = async {
                sleep_until(began + ms(holder_at)).await;
                holder
                    .sale(&format!("strategy={strategy}&work_ms={work}"))
                    .await
            };
            let fault = async {
                sleep_until(began + ms(freeze_at)).await;
                signal(&[&redis], Signal::SIGSTOP);
                sleep_until(began + ms(thaw_at)).await;
                signal(&[&redis], Signal::SIGCONT);
                tokio::time::sleep(ms(10)).await;
                other.sale(&format!("strategy={strategy}")).await
            };
            let (first, held, taken) = tokio::join!(first, held, fault);
            if let Some(first) = &first {
                assert_eq!(first.status, 200, "{what}: the first holder: {first:?}");
            }
            assert_eq!(
                taken.status, 200,
                "{what}: the lock never changed hands, nothing was tested: {taken:?}"
            );
            assert_ne!(
                held.status, 200,
                "{what}: the holder wrote after its lease ran out: {held:?}"
            );
            assert_sales(&holder, 1 + i64::from(handed), &what).await;
        }
    }
}

/// The lock's Redis (or every quorum node) frozen for half the lease while the holder works
/// past it: the renewals that fail are tried again within the lease, and one gets through.
/// A quorum holder used to try again only a third of a lease later, at the lease's end, and
/// gave its lock up without trying.
#[tokio::test(flavor = "multi_thread")]
async fn a_pause_of_the_locks_redis_shorter_than_the_lease_costs_a_holder_nothing() {
    let (redis, nodes, app) = with_three_nodes(|b| b.env("LOCK_TTL_MS", TTL_MS)).await;
    for strategy in renewing(false).chain(renewing(true)) {
        let frozen: Vec<&RedisServer> = if strategy.info().quorum {
            nodes.iter().collect()
        } else {
            vec![&redis]
        };
        app.reset(5).await;
        let began = Instant::now();
        let query = format!("strategy={strategy}&work_ms={}", TTL_MS * 3 / 2);
        let sale = app.sale(&query);
        let fault = async {
            sleep_until(began + ms(TTL_MS * 3 / 10)).await;
            signal(&frozen, Signal::SIGSTOP);
            sleep_until(began + ms(TTL_MS * 8 / 10)).await;
            signal(&frozen, Signal::SIGCONT);
        };
        let (sale, ()) = tokio::join!(sale, fault);
        assert_eq!(sale.status, 200, "{strategy}: {sale:?}");
        assert_sales(&app, 1, strategy.name()).await;
    }
}

/// Sales of two instances in line, each working longer than the lease, so that every one
/// after the first waits longer than a lease and gets the lock handed over: all sell. A
/// renewing holder counts its lease from the extension of the handed lock, not from the
/// start of its wait.
#[tokio::test(flavor = "multi_thread")]
async fn renewing_holders_in_line_longer_than_the_lease_all_sell() {
    const TTL_MS: u64 = 600;
    let redis = RedisServer::start().await;
    let start = |name: &str| {
        InstanceBuilder::new(&redis, name)
            .env("LOCK_TTL_MS", TTL_MS)
            .start()
    };
    let apps = [start("app1").await, start("app2").await];
    for strategy in renewing(false) {
        apps[0].reset(10).await;
        let query = format!("strategy={strategy}&work_ms={}", TTL_MS * 7 / 6);
        let sales = (0..4).map(|i| apps[i % 2].sale(&query));
        let sold = futures_util::future::join_all(sales).await;
        for sale in &sold {
            assert_eq!(sale.status, 200, "{strategy}: {sold:?}");
        }
        assert_sales(&apps[0], 4, strategy.name()).await;
    }
}

/// The same for the quorum lock, whose renewals go unanswered with a majority of its nodes
/// frozen: past the lease the last renewal that worked gave, with work still to finish, the
/// holder must not write, whatever its next renewal would say a tick later. Here the nodes
/// wake and the other instance takes the lock (its lease ran out on them) while the
/// holder's work goes on; before, the holder wrote too, over that sale.
#[tokio::test(flavor = "multi_thread")]
async fn a_quorum_holder_whose_renewals_go_unanswered_never_writes_past_its_lease() {
    let (redis, nodes, holder) = with_three_nodes(|b| b.env("LOCK_TTL_MS", TTL_MS)).await;
    let other = InstanceBuilder::new(&redis, "app2")
        .env("LOCK_NODES", lock_nodes(&nodes))
        .env("LOCK_TTL_MS", TTL_MS)
        .env("REDIS_TIMEOUT_MS", 300)
        .start()
        .await;
    let majority = [&nodes[0], &nodes[1]];
    for strategy in renewing(true) {
        holder.reset(5).await;
        let began = Instant::now();
        // Work past the lease: only renewals keep the lock.
        let long = format!("strategy={strategy}&work_ms={}", TTL_MS * 14 / 10);
        let held = holder.sale(&long);
        let fault = async {
            // After the first renewal (a third of the lease in), before the second.
            sleep_until(began + ms(TTL_MS * 4 / 10)).await;
            signal(&majority, Signal::SIGSTOP);
            // The lease the first renewal gave has run out on the frozen nodes.
            sleep_until(began + ms(TTL_MS * 135 / 100)).await;
            signal(&majority, Signal::SIGCONT);
            tokio::time::sleep(ms(10)).await;
            other.sale(&format!("strategy={strategy}")).await
        };
        let (held, taken) = tokio::join!(held, fault);
        assert_eq!(
            taken.status, 200,
            "{strategy}: the lock never changed hands, nothing was tested: {taken:?}"
        );
        assert_ne!(
            held.status, 200,
            "{strategy}: the holder wrote after its lease ran out: {held:?}, and {taken:?}"
        );
        assert_sales(&holder, 1, &strategy.to_string()).await;
    }
}

/// Redis runs a renewal at once, but its answer comes back late (a slow return path), later
/// than the next renewal was due: the lock then expires in Redis a lease after the renewal
/// ran, while the holder, its renewal answered, believes itself held. The next renewal used to
/// be scheduled a third of a lease after the *answer*, past the lease's end, with nothing
/// counting time meanwhile: the other instance took the expired lock and sold, and the
/// holder sold too. Now the next renewal is due a third of a lease after the *sending* of the
/// last, and goes at once when that is past, with time still counting.
#[tokio::test(flavor = "multi_thread")]
async fn a_holder_whose_renewal_is_answered_late_never_writes_past_its_lease() {
    let redis = RedisServer::start().await;
    let proxy = testkit::DelayProxy::transparent(format!("127.0.0.1:{}", redis.port()))
        .await
        .unwrap();
    let through = proxy.redis_url();
    let holder = InstanceBuilder::new(&redis, "app1")
        .env("REDIS_URL", &through)
        .env(
            "LOCK_NODES",
            (1..=3)
                .map(|db| format!("{through}/{db}"))
                .collect::<Vec<_>>()
                .join(","),
        )
        .env("LOCK_TTL_MS", TTL_MS)
        .env("REDIS_TIMEOUT_MS", TTL_MS * 3)
        .start()
        .await;
    let other = InstanceBuilder::new(&redis, "app2")
        .env("LOCK_TTL_MS", TTL_MS)
        .start()
        .await;
    let late = ms(TTL_MS * 9 / 10);
    for strategy in renewing(false).chain(renewing(true)) {
        // Every script a renewal runs loaded beforehand, so that each renewal below is one
        // round trip.
        holder.reset(5).await;
        let warm = format!("strategy={strategy}&work_ms={}", TTL_MS / 2);
        assert_eq!(
            holder.sale(&warm).await.status,
            200,
            "{strategy}: warming up"
        );
        holder.reset(5).await;
        let began = Instant::now();
        // Past the lease the first renewal (a third of a lease in) gives, short of the tick
        // a third of a lease after its late answer.
        let work = format!("strategy={strategy}&work_ms={}", TTL_MS * 145 / 100);
        let held = holder.sale(&work);
        let fault = async {
            sleep_until(began + ms(TTL_MS * 15 / 100)).await;
            proxy.delay_answers(late);
            // After the lease the first renewal gave, when its late answer is in.
            sleep_until(began + ms(TTL_MS * 136 / 100)).await;
            let taken = other.sale(&format!("strategy={strategy}")).await;
            proxy.delay_answers(Duration::ZERO);
            taken
        };
        let (held, taken) = tokio::join!(held, fault);
        assert_eq!(
            taken.status, 200,
            "{strategy}: the other instance never got the lock: {taken:?}"
        );
        assert_ne!(
            held.status, 200,
            "{strategy}: the holder wrote past its lease: {held:?}"
        );
        tokio::time::sleep(late).await;
        assert_sales(&holder, 1, strategy.name()).await;
    }
}

//! The catalog's rules of pin, withdraw and forget, against its core in
//! process: the memory is a `MemoryMap`, the configuration and the pins
//! plain data, live discoveries and calls are results handed to the core,
//! and time is paused, so the reuse window and every duration are exact
//! and none takes real time. No nats-server, no Postgres, no server
//! process: what needs them (the transaction, the bucket, real servers, the
//! subjects) is in `services/catalog/tests`.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use catalog_core::call::{
    self, Answer, CallFailure, CallRef, LiveRecord, Open, Setup, Step, classify, live_catalog,
    step, withdrawal,
};
use catalog_core::events::kinds;
use catalog_core::memory::{Bounds, MemoryMap, MemoryWrite, Put, Removed, Reuse, after_live};
use catalog_core::pins::{PinSource, ServerUse, StoredPin};
use catalog_core::prepare::{self, Outcome, Plan, ServerRef, Timings};
use catalog_core::request::{valid_call, valid_preparation};
use catalog_core::tools::{Catalog, Item, Prompt, Resource, Tool};
use catalog_core::{Discovery, ErrorCode, Failure, ItemError, ItemKind, Live, Transport};
use ctxsync_proto::v1::catalog_pin::Source;
use ctxsync_proto::v1::service_error::Code;
use ctxsync_proto::v1::{CatalogCallRequest, CatalogPrepareRequest};
use serde_json::json;
use tokio::time::Instant;

const RELEASE: &str = "1.0.0";
const TENANT: &str = "acme";
const HOUR: Duration = Duration::from_secs(3600);

// ---- data ---------------------------------------------------------------------

fn tool(name: &str, description: &str) -> Tool {
    Tool {
        name: name.into(),
        description: description.into(),
        input_schema_json: r#"{"type":"object"}"#.into(),
    }
}

/// A catalog of tools named with their descriptions; its hash says what it holds.
fn catalog(tools: &[(&str, &str)]) -> Arc<Catalog> {
    Arc::new(Catalog {
        tools: tools.iter().map(|(n, d)| tool(n, d)).collect(),
        prompts: Vec::new(),
        resources: Vec::new(),
        hash: format!("{tools:?}"),
    })
}

fn server<'a>(id: &'a str, transport: Transport) -> ServerRef<'a> {
    ServerRef {
        id,
        key: id,
        transport,
        // Leaked: a test's few rules live as long as the test binary.
        naming: Box::leak(Box::new(catalog_core::naming::NameRule::prefixed(id))),
    }
}

fn stored_pin(server_id: &str, catalog: &Catalog) -> StoredPin {
    StoredPin {
        server_id: server_id.into(),
        server_key: server_id.into(),
        transport: "stdio".into(),
        source: PinSource::Pinned,
        catalog: catalog.clone(),
        naming: catalog_core::naming::NameRule::prefixed(server_id),
    }
}

fn call_of<'a>(server_id: &'a str, item: Item<'a>) -> CallRef<'a> {
    CallRef {
        tenant: TENANT,
        session_id: "s1",
        server_id,
        item,
    }
}

/// The wall clock of the memory's entries, moving with paused tokio time.
struct Clock {
    wall: SystemTime,
    started: Instant,
}

impl Clock {
    fn new() -> Self {
        Self {
            wall: SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000),
            started: Instant::now(),
        }
    }

    fn now(&self) -> SystemTime {
        self.wall + self.started.elapsed()
    }
}

// ---- the catalog's memory and its decisions, composed as the adapter does ------

/// A replica's memory with the reuse rule of its settings.
struct World {
    memory: MemoryMap<String>,
    reuse: Reuse,
    clock: Clock,
}

impl World {
    fn new() -> Self {
        Self {
            memory: MemoryMap::new(Bounds {
                max_entries: 4096,
                max_bytes: 64 << 20,
            }),
            reuse: Reuse { http_window: HOUR },
            clock: Clock::new(),
        }
    }

    /// What a live attempt teaches the memory, as discovery applies it.
    fn learn(&mut self, server: ServerRef<'_>, result: &Result<Live, Failure>) {
        match after_live(result) {
            MemoryWrite::Remember(catalog, _) => {
                let discovery = Discovery {
                    catalog,
                    transport: server.transport,
                    discovered_at: self.clock.now(),
                    release: RELEASE.into(),
                    upstream_ttl: None,
                };
                assert_eq!(
                    self.memory.put(server.key.to_owned(), discovery, 100),
                    Put::Stored
                );
            }
            MemoryWrite::Forget => {
                self.memory.remove(&server.key.to_owned());
            }
        }
    }

    /// A preparation's plan over this memory, now.
    fn plan(&self, servers: &[ServerRef<'_>]) -> Plan {
        let now = self.clock.now();
        Plan::new(servers.iter().map(|s| {
            let discovery = self.memory.reusable(&s.key.to_owned(), self.reuse, now);
            discovery.map(|d| d.catalog.clone())
        }))
    }

    /// A whole preparation: the plan, the live discoveries it needs (each
    /// taking `took` of paused time, answering `live(server)`), what the
    /// memory learns, and the outcomes.
    async fn prepare(
        &mut self,
        servers: &[ServerRef<'_>],
        took: Duration,
        live: impl Fn(&str) -> Result<Arc<Catalog>, Failure>,
    ) -> Vec<Outcome> {
        let plan = self.plan(servers);
        let mut results = Vec::new();
        for i in plan.to_discover() {
            let started = Instant::now();
            tokio::time::sleep(took).await;
            let result = live(servers[i].id).map(|catalog| Live {
                catalog,
                duration: started.elapsed(),
                upstream_ttl: None,
            });
            self.learn(servers[i], &result);
            results.push(result);
        }
        plan.discovered(results)
    }

    fn pins(&self, servers: &[ServerRef<'_>]) -> Vec<bool> {
        self.plan(servers)
            .discovered(std::iter::repeat_with(|| Err(failure("unused"))))
            .iter()
            .map(|o| matches!(o, Outcome::Remembered(_)))
            .collect()
    }
}

fn failure(kind: &'static str) -> Failure {
    Failure {
        kind,
        message: "the server exited before answering initialize".into(),
        duration: Duration::from_millis(40),
    }
}

fn kinds_of(events: &[catalog_core::events::NewEvent]) -> Vec<&str> {
    events.iter().map(|e| e.kind).collect()
}

// ---- pin ------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_remembered_server_is_pinned_without_a_start_and_the_others_are_discovered_live() {
    let mut world = World::new();
    let servers = [
        server("fx", Transport::Stdio),
        server("web", Transport::StreamableHttp),
    ];
    let fx = catalog(&[("echo", "Echo"), ("add", "Add")]);
    let web = catalog(&[("fetch", "Fetch")]);
    let live = |id: &str| Ok(if id == "fx" { fx.clone() } else { web.clone() });

    let first = world
        .prepare(&servers, Duration::from_millis(300), live)
        .await;
    assert!(first.iter().all(|o| matches!(o, Outcome::Connected(_))));
    let writes = prepare::writes(TENANT, "s1", &servers, &first);
    assert_eq!(
        kinds_of(&writes.events),
        [kinds::SERVER_CONNECTED, kinds::SERVER_CONNECTED]
    );
    let payload = &writes.events[0].payload;
    assert_eq!(payload["duration_ms"], 300, "the discovery's own time");
    assert_eq!(payload["cause"], "preparation");
    assert_eq!(payload["transport"], "stdio");
    assert_eq!(payload["tool_count"], 2);

    // The next session starts nothing: both are remembered.
    let plan = world.plan(&servers);
    assert!(
        !plan.must_discover(),
        "no start, so no look-up of the session first"
    );
    let started = Instant::now();
    let second = world.prepare(&servers, Duration::from_millis(300), |_| {
        panic!("a remembered server is not started")
    });
    let second = second.await;
    assert_eq!(started.elapsed(), Duration::ZERO, "pinned without waiting");
    let writes = prepare::writes(TENANT, "s2", &servers, &second);
    assert_eq!(
        kinds_of(&writes.events),
        [kinds::SERVER_PINNED, kinds::SERVER_PINNED]
    );
    assert_eq!(writes.events[0].payload["catalog_hash"], fx.hash.as_str());
    assert_eq!(writes.events[1].payload["transport"], "streamable_http");
    assert_eq!(writes.counts.pinned, 2);
    let sources: Vec<_> = writes.pins.iter().map(|p| p.source).collect();
    assert_eq!(sources, [PinSource::Pinned, PinSource::Pinned]);
    let reply = prepare::reply_pins(&servers, second);
    assert_eq!(reply[0].source, Source::Pinned as i32);
    assert_eq!(
        reply[0].tools,
        fx.to_pin().tools,
        "the remembered declarations"
    );
    assert_eq!(reply[0].handshake_ms, 0);
}

#[tokio::test(start_paused = true)]
async fn a_stdio_entry_is_reused_until_replaced_or_forgotten() {
    let mut world = World::new();
    let servers = [server("fx", Transport::Stdio)];
    world
        .prepare(&servers, Duration::ZERO, |_| {
            Ok(catalog(&[("echo", "Echo")]))
        })
        .await;
    tokio::time::advance(365 * 24 * HOUR).await;
    assert_eq!(world.pins(&servers), [true], "a stdio entry has no window");
}

#[tokio::test(start_paused = true)]
async fn an_http_entry_is_reused_within_the_window_after_its_discovery_only() {
    let mut world = World::new();
    let servers = [server("web", Transport::StreamableHttp)];
    world
        .prepare(&servers, Duration::ZERO, |_| {
            Ok(catalog(&[("fetch", "Fetch")]))
        })
        .await;
    tokio::time::advance(HOUR).await;
    assert_eq!(world.pins(&servers), [true], "at the window's end: reused");
    tokio::time::advance(Duration::from_millis(1)).await;
    assert_eq!(world.pins(&servers), [false], "past it: discovered live");

    // The window runs from the discovery time in the entry, not from when
    // this replica learned it: another replica's entry of 59 minutes ago
    // has one minute left here.
    let discovery = Discovery {
        catalog: catalog(&[("fetch", "Fetch")]),
        transport: Transport::StreamableHttp,
        discovered_at: world.clock.now() - Duration::from_secs(59 * 60),
        release: RELEASE.into(),
        upstream_ttl: None,
    };
    world.memory.put("web".into(), discovery, 100);
    assert_eq!(world.pins(&servers), [true]);
    tokio::time::advance(Duration::from_secs(61)).await;
    assert_eq!(world.pins(&servers), [false]);
}

#[tokio::test(start_paused = true)]
async fn a_failed_discovery_is_answered_failed_with_its_error_and_not_pinned() {
    let mut world = World::new();
    let servers = [
        server("bad", Transport::Stdio),
        server("ok", Transport::Stdio),
    ];
    let outcomes = world
        .prepare(&servers, Duration::from_millis(40), |id| {
            if id == "bad" {
                Err(failure("exited"))
            } else {
                Ok(catalog(&[("echo", "Echo")]))
            }
        })
        .await;
    let writes = prepare::writes(TENANT, "s1", &servers, &outcomes);
    let pinned: Vec<_> = writes.pins.iter().map(|p| p.server_id).collect();
    assert_eq!(pinned, ["ok"], "a failed server is not pinned");
    assert_eq!(
        kinds_of(&writes.events),
        [kinds::SERVER_CONNECT_FAILED, kinds::SERVER_CONNECTED]
    );
    let failed = &writes.events[0].payload;
    assert_eq!(failed["error_kind"], "exited");
    assert!(
        !failed.to_string().contains("initialize"),
        "no error text in an event: {failed}"
    );
    assert_eq!((writes.counts.failed, writes.counts.connected), (1, 1));
    let reply = prepare::reply_pins(&servers, outcomes);
    assert_eq!(reply[0].source, Source::Failed as i32);
    assert_eq!(
        reply[0].error,
        "the server exited before answering initialize"
    );
    assert!(reply[0].tools.is_empty());
    assert_eq!(
        world.pins(&servers),
        [false, true],
        "and it is not remembered"
    );
}

#[test]
fn pins_and_events_follow_the_configured_order_then_the_session_event() {
    let servers = [
        server("first", Transport::Stdio),
        server("second", Transport::StreamableHttp),
        server("third", Transport::Stdio),
    ];
    let outcomes = vec![
        Outcome::Remembered(catalog(&[("a", "A")])),
        Outcome::Failed(failure("timeout")),
        Outcome::Connected(Live {
            catalog: catalog(&[("b", "B")]),
            duration: Duration::from_millis(7),
            upstream_ttl: None,
        }),
    ];
    let writes = prepare::writes(TENANT, "s1", &servers, &outcomes);
    let order: Vec<_> = writes
        .events
        .iter()
        .map(|e| e.server_id.as_deref().unwrap())
        .collect();
    assert_eq!(order, ["first", "second", "third"]);
    let pinned: Vec<_> = writes
        .pins
        .iter()
        .map(|p| (p.server_id, p.source))
        .collect();
    assert_eq!(
        pinned,
        [
            ("first", PinSource::Pinned),
            ("third", PinSource::Connected)
        ]
    );
    let timings = Timings {
        total: Duration::from_micros(2500),
        lookup: Duration::from_micros(10),
        discovery: Duration::from_millis(2),
        write: Duration::from_micros(400),
    };
    let prepared = prepare::prepared_event(TENANT, "s1", 3, writes.counts, timings);
    assert_eq!(prepared.kind, kinds::SESSION_PREPARED);
    assert_eq!(prepared.server_id, None);
    assert_eq!(
        prepared.payload,
        json!({
            "follow_up": false, "duration_ms": 2.5, "lookup_ms": 0.01,
            "discovery_ms": 2.0, "write_ms": 0.4,
            "servers": 3, "pinned": 1, "connected": 1, "failed": 1,
        })
    );
}

#[test]
fn a_session_asked_again_answers_its_stored_pins() {
    let pin = StoredPin {
        transport: "streamable_http".into(),
        source: PinSource::Connected,
        ..stored_pin("web", &catalog(&[("fetch", "Fetch")]))
    };
    let proto = pin.to_proto();
    assert_eq!(proto.server_id, "web");
    assert_eq!(proto.source, Source::Connected as i32);
    assert_eq!(
        proto.transport,
        ctxsync_proto::v1::McpTransport::StreamableHttp as i32
    );
    assert_eq!(proto.tools[0].name, "fetch");
    let event = prepare::follow_up_event(TENANT, "s1", 1, Duration::from_micros(1500));
    assert_eq!(
        event.payload,
        json!({"follow_up": true, "duration_ms": 1.5, "servers": 1})
    );
}

#[tokio::test(start_paused = true)]
async fn an_entry_of_another_release_is_pinned_but_warmed_first() {
    let mut world = World::new();
    let since = world.clock.now();
    let foreign = Discovery {
        catalog: catalog(&[("echo", "Old echo")]),
        transport: Transport::Stdio,
        discovered_at: since,
        release: "0.0.0-previous".into(),
        upstream_ttl: None,
    };
    world.memory.put("old".into(), foreign, 100);
    world
        .prepare(&[server("new", Transport::Stdio)], Duration::ZERO, |_| {
            Ok(catalog(&[("echo", "Echo")]))
        })
        .await;
    let servers = [
        server("old", Transport::Stdio),
        server("new", Transport::Stdio),
    ];
    assert_eq!(
        world.pins(&servers),
        [true, true],
        "another release's entry is pinned"
    );
    let (reuse, now) = (world.reuse, world.clock.now());
    let warm = |key: &str| {
        world
            .memory
            .warmed_since(&key.to_owned(), reuse, now, since, RELEASE)
    };
    assert!(!warm("old"), "the warm-up discovers it again");
    assert!(
        warm("new"),
        "this release's own entry since the start is not"
    );
    assert!(
        world
            .memory
            .get(&"old".to_owned())
            .unwrap()
            .is_foreign(RELEASE)
            && !world
                .memory
                .get(&"new".to_owned())
                .unwrap()
                .is_foreign(RELEASE)
    );
}

// ---- forget ---------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_failed_live_attempt_forgets_the_entry_and_the_next_preparation_is_live() {
    let mut world = World::new();
    let servers = [server("fx", Transport::Stdio)];
    world
        .prepare(&servers, Duration::ZERO, |_| {
            Ok(catalog(&[("echo", "Echo")]))
        })
        .await;
    assert_eq!(world.pins(&servers), [true]);
    // A call's connect fails: the memory forgets the server.
    world.learn(servers[0], &Err(failure("exited")));
    assert!(world.memory.is_empty());
    assert_eq!(
        world.pins(&servers),
        [false],
        "nothing remembered: live next time"
    );
}

#[tokio::test(start_paused = true)]
async fn every_live_discovery_replaces_the_entry() {
    let mut world = World::new();
    let servers = [server("fx", Transport::Stdio)];
    world
        .prepare(&servers, Duration::ZERO, |_| {
            Ok(catalog(&[("echo", "Echo")]))
        })
        .await;
    // A call's connect (or a re-list) finds other tools: they replace the entry.
    let relisted = catalog(&[("echo", "Echo changed")]);
    world.learn(
        servers[0],
        &Ok(Live {
            catalog: relisted.clone(),
            duration: Duration::ZERO,
            upstream_ttl: None,
        }),
    );
    let outcomes = world
        .prepare(&servers, Duration::ZERO, |_| panic!("remembered"))
        .await;
    assert_eq!(outcomes[0].catalog().unwrap().hash, relisted.hash);
    assert_eq!(world.memory.len(), 1);
}

#[test]
fn the_memory_past_its_bounds_refuses_new_keys_and_still_replaces_or_forgets_held_ones() {
    let mut memory = MemoryMap::new(Bounds {
        max_entries: 2,
        max_bytes: 1000,
    });
    let entry = |tools: &[(&str, &str)]| Discovery {
        catalog: catalog(tools),
        transport: Transport::Stdio,
        discovered_at: SystemTime::UNIX_EPOCH,
        release: RELEASE.into(),
        upstream_ttl: None,
    };
    assert_eq!(memory.put("a", entry(&[("x", "X")]), 300), Put::Stored);
    assert_eq!(memory.put("b", entry(&[("x", "X")]), 300), Put::Stored);
    assert_eq!(
        memory.put("c", entry(&[("x", "X")]), 10),
        Put::Refused { newly_full: true },
        "a third key past max_entries, said once"
    );
    assert_eq!(
        memory.put("d", entry(&[("x", "X")]), 10),
        Put::Refused { newly_full: false }
    );
    assert_eq!(
        memory.put("a", entry(&[("y", "Y")]), 600),
        Put::Stored,
        "replaced"
    );
    assert_eq!(memory.bytes(), 900);
    assert_eq!(
        memory.put("b", entry(&[("y", "Y")]), 500),
        Put::Refused { newly_full: false },
        "a replacement past max_bytes is refused too"
    );
    assert_eq!(memory.remove(&"b"), Removed::Removed { room_again: true });
    assert_eq!(memory.remove(&"b"), Removed::Absent);
    assert_eq!(memory.put("c", entry(&[("x", "X")]), 10), Put::Stored);
    assert_eq!((memory.len(), memory.bytes()), (2, 610));
}

#[test]
fn an_unshared_write_goes_into_the_bucket_unless_something_newer_is_there() {
    use catalog_core::memory::InBucket::{Entry, Forgotten, Nothing, Unreadable};
    use catalog_core::memory::Unshared::{Forget, Put};
    use catalog_core::memory::WriteBack::{AlreadyForgotten, Superseded, Write};
    use catalog_core::memory::write_back;
    let at = |s: u64| SystemTime::UNIX_EPOCH + Duration::from_secs(s);
    let cases = [
        // A discovery the bucket never saw: written, over anything older.
        (Put(at(10)), Nothing, Write),
        (Put(at(10)), Entry(at(9)), Write),
        (Put(at(10)), Forgotten(at(9)), Write),
        (Put(at(10)), Unreadable, Write),
        // Another replica discovered or forgot it since: that stays.
        (Put(at(10)), Entry(at(10)), Superseded),
        (Put(at(10)), Entry(at(11)), Superseded),
        (Put(at(10)), Forgotten(at(11)), Superseded),
        // A failed attempt forgets an older entry, never a newer one.
        (Forget(at(10)), Entry(at(9)), Write),
        (Forget(at(10)), Entry(at(10)), Write),
        (Forget(at(10)), Entry(at(11)), Superseded),
        (Forget(at(10)), Nothing, AlreadyForgotten),
        (Forget(at(10)), Forgotten(at(5)), AlreadyForgotten),
        (Forget(at(10)), Unreadable, AlreadyForgotten),
    ];
    for (unshared, in_bucket, expected) in cases {
        assert_eq!(
            write_back(unshared, in_bucket),
            expected,
            "{unshared:?} over {in_bucket:?}"
        );
    }
}

#[test]
fn a_server_never_pinned_or_no_longer_configured_is_refused() {
    let pin = stored_pin("fx", &catalog(&[("echo", "Echo")]));
    let call = call_of("fx", Item::Tool("echo"));
    let refusal = call::target(&call, None, Some(())).unwrap_err();
    assert_eq!(refusal.code, ErrorCode::ServerNotPinned);
    assert_eq!(refusal.code.as_str(), "server.not_pinned");
    let refusal = call::target::<()>(&call, Some(&pin), None).unwrap_err();
    assert_eq!(refusal.code, ErrorCode::ServerNotConfigured);
    assert_eq!(
        refusal.message,
        r#"server "fx" is no longer configured or enabled"#
    );
    assert!(call::target(&call, Some(&pin), Some("configured")).is_ok());
}

// ---- withdraw -------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn items_changed_or_removed_since_the_pin_are_withdrawn_and_added_ones_stay_unknown() {
    let pinned = catalog(&[("echo", "Echo"), ("add", "Add"), ("gone", "Soon removed")]);
    let pin = stored_pin("fx", &pinned);
    let live = catalog(&[
        ("echo", "Echo"),
        ("add", "Add, now differently"),
        ("new", "New"),
    ]);

    // An item the pin never had is unknown, before any start.
    let added = call_of("fx", Item::Tool("new"));
    let refusal = call::target(&added, Some(&pin), Some(())).unwrap_err();
    assert_eq!(refusal.code.as_str(), "tool.not_found");

    let echo = call_of("fx", Item::Tool("echo"));
    let LiveRecord {
        diff,
        events,
        changed,
    } = live_catalog(
        &echo,
        Transport::Stdio,
        &pin,
        &live,
        Some(Duration::from_millis(250)),
        &ServerUse::default(),
    );
    assert!(changed);
    assert_eq!(
        kinds_of(&events),
        [kinds::SERVER_CONNECTED, kinds::CATALOG_CHANGED]
    );
    assert_eq!(events[0].payload["cause"], "call");
    assert_eq!(events[0].payload["duration_ms"], 250);
    let payload = &events[1].payload;
    assert_eq!(payload["previous_hash"], pinned.hash.as_str());
    assert_eq!(payload["catalog_hash"], live.hash.as_str());
    assert_eq!(
        (&payload["added"], &payload["removed"], &payload["changed"]),
        (&json!(["new"]), &json!(["gone"]), &json!(["add"]))
    );

    assert_eq!(
        withdrawal(&echo, &diff),
        None,
        "an unchanged tool still works"
    );
    let changed = withdrawal(&call_of("fx", Item::Tool("add")), &diff).unwrap();
    assert_eq!(changed.code.as_str(), "tool.withdrawn");
    assert_eq!(
        changed.message,
        r#"tool "add" of server "fx" was changed since the session pinned it"#
    );
    let removed = withdrawal(&call_of("fx", Item::Tool("gone")), &diff).unwrap();
    assert!(
        removed.message.contains("was removed"),
        "{}",
        removed.message
    );
}

#[test]
fn a_prompts_or_resources_codes_carry_its_own_prefix() {
    let mut pinned = (*catalog(&[("echo", "Echo")])).clone();
    pinned.prompts = vec![Prompt::declared(
        "greet".into(),
        r#"{"name":"greet"}"#.into(),
    )];
    pinned.resources = vec![Resource::declared(
        "test://a".into(),
        r#"{"uri":"test://a","name":"a"}"#.into(),
    )];
    let pin = stored_pin("fx", &pinned);
    let mut live = pinned.clone();
    live.prompts = vec![Prompt::declared(
        "greet".into(),
        r#"{"name":"greet","description":"new"}"#.into(),
    )];
    live.resources.clear();
    live.hash = "live".into();
    let diff = pin.catalog.diff(&live);
    let prompt = call_of("fx", Item::Prompt("greet"));
    assert_eq!(
        withdrawal(&prompt, &diff).unwrap().code,
        ErrorCode::Item(ItemKind::Prompt, ItemError::Withdrawn)
    );
    let resource = call_of("fx", Item::Resource("test://a"));
    assert_eq!(
        withdrawal(&resource, &diff).unwrap().code.as_str(),
        "resource.withdrawn"
    );
    let unknown = call_of("fx", Item::Resource("test://b"));
    assert_eq!(
        call::target(&unknown, Some(&pin), Some(()))
            .unwrap_err()
            .code
            .as_str(),
        "resource.not_found"
    );
    let timeout = classify(
        &prompt,
        Err(CallFailure::Timeout {
            after: Duration::from_secs(60),
        }),
        1 << 20,
    );
    let error = timeout.reply.error.unwrap();
    assert_eq!(
        (error.reason.as_str(), error.code()),
        ("prompt.timeout", Code::DeadlineExceeded)
    );
}

#[test]
fn a_changed_catalog_is_recorded_once_per_session_server_and_hash() {
    let pinned = catalog(&[("echo", "Echo")]);
    let pin = stored_pin("fx", &pinned);
    let call = call_of("fx", Item::Tool("echo"));
    let mut server_use = ServerUse::default();
    server_use.count_call(&pin);
    let changed_to = |catalog: &Catalog, server_use: &ServerUse| {
        live_catalog(&call, Transport::Stdio, &pin, catalog, None, server_use).changed
    };
    let second = catalog(&[("echo", "Echo 2")]);
    assert!(changed_to(&second, &server_use));
    server_use.reported(&second.hash);
    assert!(!changed_to(&second, &server_use), "reported once");
    let record = live_catalog(&call, Transport::Stdio, &pin, &second, None, &server_use);
    assert!(
        record.events.is_empty(),
        "a re-list with nothing new writes nothing"
    );
    let third = catalog(&[("echo", "Echo 3")]);
    assert!(
        changed_to(&third, &server_use),
        "another hash is another change"
    );
    assert!(
        !changed_to(&pinned, &server_use),
        "back to the pin is no change"
    );
}

// ---- lazy start -------------------------------------------------------------------

#[test]
fn a_pinned_server_starts_on_first_use_and_its_transport_serves_the_later_calls() {
    assert_eq!(step(None), Step::Connect, "nothing open: a start");
    let open = Open {
        closed: false,
        list_changed: false,
    };
    assert_eq!(
        step(Some(open)),
        Step::Use,
        "the session's transport is reused"
    );
    let changed = Open {
        list_changed: true,
        ..open
    };
    assert_eq!(step(Some(changed)), Step::Relist);
    let dead = Open {
        closed: true,
        list_changed: true,
    };
    assert_eq!(
        step(Some(dead)),
        Step::Connect,
        "a dead transport reconnects"
    );

    let pin = stored_pin("fx", &catalog(&[("echo", "Echo")]));
    let mut server_use = ServerUse::default();
    assert!(server_use.count_call(&pin), "the first call");
    assert!(!server_use.count_call(&pin));
    let event = call::called_event(
        &call_of("fx", Item::Tool("echo")),
        Transport::Stdio,
        true,
        "ok",
        Duration::from_micros(1200),
        Setup {
            connected: true,
            duration: Duration::from_millis(300),
        },
    );
    assert_eq!(event.kind, kinds::TOOL_CALLED);
    assert_eq!(
        event.payload,
        json!({
            "transport": "stdio", "tool": "echo", "outcome": "ok", "first_call": true,
            "connected": true, "setup_ms": 300.0, "duration_ms": 1.2,
        })
    );
}

#[test]
fn a_connect_that_fails_answers_server_unreachable_and_records_both_events() {
    let call = call_of("fx", Item::Resource("test://a"));
    let (refusal, events) = call::unreachable(&call, Transport::Stdio, &failure("exited"), true);
    assert_eq!(refusal.code.as_str(), "resource.server_unreachable");
    assert_eq!(
        refusal.message,
        r#"server "fx" is unreachable: the server exited before answering initialize"#
    );
    assert_eq!(
        kinds_of(&events),
        [kinds::SERVER_CONNECT_FAILED, kinds::RESOURCE_READ]
    );
    assert_eq!(events[1].payload["outcome"], "server_unreachable");
    assert_eq!(events[1].payload["uri"], "test://a");
}

// ---- the answer -----------------------------------------------------------------

#[test]
fn an_answer_is_classified_within_the_servers_limit() {
    let call = call_of("fx", Item::Tool("echo"));
    let answer = |text: &str, is_error| {
        Ok(Answer {
            is_error,
            content_json: text.into(),
        })
    };
    let fits = classify(&call, answer("short", false), 64);
    assert!(fits.reply.ok && fits.outcome == "ok" && !fits.transport_broke);
    let tool_error = classify(&call, answer("nope", true), 64);
    assert!(tool_error.reply.ok && tool_error.reply.is_error);
    assert_eq!(tool_error.outcome, "tool_error");

    let long = "x".repeat(200);
    let refused = classify(&call, answer(&long, false), 64);
    let error = refused.reply.error.unwrap();
    assert_eq!(
        (error.reason.as_str(), error.code()),
        ("tool.result_too_large", Code::ResourceExhausted)
    );
    assert!(
        error.message.contains("max_content_bytes = 64"),
        "{}",
        error.message
    );
    assert!(!error.message.contains(&long), "the result is never echoed");
    assert_eq!(refused.outcome, "result_too_large");

    let failed = classify(
        &call,
        Err(CallFailure::Protocol {
            message: "invalid params".into(),
        }),
        64,
    );
    assert_eq!(
        (failed.reply.error.unwrap().reason.as_str(), failed.outcome),
        ("tool.call_failed", "call_failed")
    );
    let broke = classify(
        &call,
        Err(CallFailure::Transport {
            message: "connection closed".into(),
        }),
        64,
    );
    assert!(broke.transport_broke, "the next call reconnects");
    let error = broke.reply.error.unwrap();
    assert_eq!(
        (error.reason.as_str(), error.code()),
        ("tool.server_unreachable", Code::Unavailable)
    );
}

// ---- requests -------------------------------------------------------------------

#[test]
fn bad_requests_are_answered_with_reasons() {
    let prepare = |session: &str| CatalogPrepareRequest {
        tenant: TENANT.into(),
        session_id: session.into(),
    };
    let refusal = valid_preparation(&prepare("")).unwrap_err();
    assert_eq!(refusal.code.as_str(), "request.invalid");
    assert_eq!(refusal.message, "session_id is empty");
    let long = valid_preparation(&prepare(&"x".repeat(300))).unwrap_err();
    assert!(long.message.contains("256"), "{}", long.message);
    let nul = valid_preparation(&prepare("s\0")).unwrap_err();
    assert_eq!(nul.message, "session_id contains U+0000 (NUL) at byte 1");
    assert!(valid_preparation(&prepare("s1")).is_ok());
    assert_eq!(
        prepare::tenant_unknown("nobody").code.as_str(),
        "tenant.unknown"
    );
    assert_eq!(
        call::session_not_prepared(TENANT, "never").code.as_str(),
        "session.not_prepared"
    );

    let call = |arguments: &str| CatalogCallRequest {
        tenant: TENANT.into(),
        session_id: "s1".into(),
        server_id: "fx".into(),
        tool: "echo".into(),
        arguments_json: arguments.into(),
        ..Default::default()
    };
    let array = valid_call(&call("[1, 2]")).unwrap_err();
    assert_eq!(array.message, "arguments_json is not a JSON object");
    let broken = valid_call(&call(r#"{"secret": "#)).unwrap_err();
    assert!(
        !broken.message.contains("secret"),
        "never echoed: {}",
        broken.message
    );
    assert!(
        valid_call(&call("")).unwrap().is_empty(),
        "no arguments is an empty object"
    );
    assert_eq!(valid_call(&call(r#"{"text":"hi"}"#)).unwrap()["text"], "hi");
    let two = CatalogCallRequest {
        prompt: "greet".into(),
        ..call("")
    };
    assert_eq!(
        valid_call(&two).unwrap_err().message,
        "name exactly one of tool, prompt and resource_uri"
    );
    let uri = CatalogCallRequest {
        tool: String::new(),
        resource_uri: format!("test://{}", "u".repeat(8192)),
        ..call("")
    };
    assert!(valid_call(&uri).unwrap_err().message.contains("8192"));
}

#[test]
fn a_request_about_a_server_needs_its_pin_and_its_configuration_only() {
    let catalog = catalog(&[("echo", "Echo")]);
    let pin = stored_pin("fx", &catalog);
    let refused = |result: Result<(&StoredPin, ()), catalog_core::Refusal>| {
        result.map(|_| ()).unwrap_err().code
    };
    assert_eq!(
        refused(call::server_target("fx", None, Some(()))),
        ErrorCode::ServerNotPinned
    );
    assert_eq!(
        refused(call::server_target("fx", Some(&pin), None::<()>)),
        ErrorCode::ServerNotConfigured
    );
    assert!(call::server_target("fx", Some(&pin), Some(())).is_ok());
}

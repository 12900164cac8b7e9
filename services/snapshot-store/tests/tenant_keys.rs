//! Tenant keys in snapshot-store, over its NATS API: verified by digest,
//! revoked with an announcement after commit, bad input refused by name with
//! nothing written.

mod common;

use common::*;
use ctxsync_proto::Message;
use ctxsync_proto::rpc::store;
use ctxsync_proto::v1::service_error::Code;
use ctxsync_proto::v1::*;
use futures::StreamExt;

async fn verify(h: &StoreHarness, key: &str) -> VerifyTenantKeyReply {
    h.api
        .request::<store::VerifyTenantKey>(&VerifyTenantKeyRequest {
            key_sha256: sha(key),
        })
        .await
}

async fn create(
    h: &StoreHarness,
    tenant: &str,
    label: &str,
    digest: Vec<u8>,
) -> CreateTenantKeyReply {
    h.api
        .request::<store::CreateTenantKey>(&CreateTenantKeyRequest {
            tenant: tenant.into(),
            label: label.into(),
            key_sha256: digest,
        })
        .await
}

#[tokio::test]
async fn a_key_verifies_to_its_tenant_until_revoked_and_the_revocation_is_announced() {
    let h = StoreHarness::spawn().await;
    let mut revocations = testkit::subscribe(&h.client, h.subjects.tenant_key_revoked()).await;
    let (key, key_id) = h.api.create_tenant_key("acme").await;

    let verified = verify(&h, &key).await;
    let found = verified.key.expect("a valid key");
    assert_eq!(
        (found.tenant.as_str(), found.key_id.as_str()),
        ("acme", key_id.as_str())
    );
    assert!(found.revoked_at.is_none());
    assert!(
        verify(&h, &testkit::store::new_tenant_key())
            .await
            .key
            .is_none()
    );

    h.api.revoke_tenant_key(&key_id).await;
    let event = tokio::time::timeout(TIMEOUT, revocations.next())
        .await
        .expect("the revocation is announced")
        .unwrap();
    let event = TenantKeyRevoked::decode(event.payload).unwrap();
    assert_eq!(
        (event.key_id.as_str(), event.tenant.as_str()),
        (key_id.as_str(), "acme")
    );
    assert!(
        verify(&h, &key).await.key.is_none(),
        "a revoked key no longer verifies"
    );
}

#[tokio::test]
async fn bad_tenant_key_requests_are_refused_by_field_and_write_nothing() {
    let h = StoreHarness::spawn().await;
    let pool = sqlx::PgPool::connect(h.db.url()).await.unwrap();
    let digest = sha("cxk_whatever");
    for (tenant, label, digest, field) in [
        ("bad tenant", "", digest.clone(), "tenant"),
        ("", "", digest.clone(), "tenant"),
        (&"t".repeat(65) as &str, "", digest.clone(), "tenant"),
        (
            "acme",
            &"l".repeat(257) as &str,
            digest.clone(),
            "label_bytes",
        ),
        ("acme", "line\nbreak", digest.clone(), "label"),
        ("acme", "", vec![0u8; 31], "key_sha256"),
    ] {
        let reply = create(&h, tenant, label, digest).await;
        let error = reply.error.expect("refused");
        assert_eq!(error.code(), Code::InvalidArgument, "{error:?}");
        assert!(error.message.contains(field), "{field}: {}", error.message);
    }
    // The same digest twice is one key.
    assert_eq!(create(&h, "acme", "", digest.clone()).await.error, None);
    assert!(create(&h, "globex", "", digest).await.error.is_some());
    let keys: i64 = sqlx::query_scalar("SELECT count(*) FROM snapshot.tenant_keys")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(keys, 1);
}

package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"
)

// compareResult is what informer-compare prints.
type compareResult struct {
	Equal       bool        `json:"equal"`
	ViaCount    int         `json:"via_count"`
	DirectCount int         `json:"direct_count"`
	Churned     int         `json:"churned"`
	Diff        []diffEntry `json:"diff"`
}

// diffEntry is one object on which the two stores disagree. An empty
// resourceVersion means the object is missing from that store.
type diffEntry struct {
	Key      string `json:"key"`
	ViaRV    string `json:"via_rv"`
	DirectRV string `json:"direct_rv"`
	Reason   string `json:"reason"`
}

// maxDiff bounds how many differences are reported.
const maxDiff = 10

// state is what the comparison looks at for one object.
type state struct {
	RV   string
	Hash string
}

// informerCompare runs one SharedInformer through each kubeconfig, applies
// optional churn through the direct one, and waits until both stores agree.
func informerCompare(args []string) (any, error) {
	fs := newFlagSet("informer-compare")
	via := fs.String("via", "", "kubeconfig of the path under test (e.g. through Bulwark)")
	direct := fs.String("direct", "", "kubeconfig straight to the kube-apiserver (the reference; churn is written here)")
	resource := fs.String("resource", "secrets", "secrets or endpointslices")
	namespace := fs.String("namespace", "", "namespace to watch (default: all); churn goes here when set")
	accept := fs.String("accept", "", "rest.Config.AcceptContentTypes for the via client, e.g. 'application/vnd.kubernetes.protobuf,application/json'")
	contentType := fs.String("content-type", "", "rest.Config.ContentType for the via client (default: first type of --accept)")
	watchList := fs.Bool("watchlist", false, "use the WatchList (streaming list) client; without it the informers LIST then WATCH")
	churn := fs.Int("churn", 0, "number of create/update/delete writes to make after the initial sync")
	timeout := fs.Duration("timeout", 60*time.Second, "overall time limit (sync, churn and agreement)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if *via == "" || *direct == "" {
		return nil, errors.New("--via and --direct are required")
	}
	if *resource != "secrets" && *resource != "endpointslices" {
		return nil, fmt.Errorf("--resource must be secrets or endpointslices, not %q", *resource)
	}

	// client-go reads its feature gates from KUBE_FEATURE_* once, on first
	// use; set the gate before any client or informer exists. WatchListClient
	// is on by default since 1.35, so it is switched off explicitly when
	// --watchlist is not given.
	if err := os.Setenv("KUBE_FEATURE_WatchListClient", strconv.FormatBool(*watchList)); err != nil {
		return nil, err
	}

	viaClient, err := clientFor(*via, *accept, *contentType)
	if err != nil {
		return nil, err
	}
	directClient, err := clientFor(*direct, "", "")
	if err != nil {
		return nil, err
	}

	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()

	viaStore, err := startInformer(ctx, viaClient, *resource, *namespace)
	if err != nil {
		return nil, fmt.Errorf("via informer: %w", err)
	}
	directStore, err := startInformer(ctx, directClient, *resource, *namespace)
	if err != nil {
		return nil, fmt.Errorf("direct informer: %w", err)
	}

	// expected holds the last state written for each churned object (an
	// empty RV for a deleted one), so agreement is not declared while both
	// stores are still equally behind.
	expected := map[string]string{}
	if *churn > 0 {
		ns, created, err := churnNamespace(ctx, directClient, *namespace)
		if err != nil {
			return nil, err
		}
		// After the comparison, best effort: delete the churn objects still
		// there, then the namespace if this run made it. Without a
		// kube-controller-manager a deleted namespace stays Terminating, so
		// its objects are deleted one by one rather than left to it.
		defer func() {
			cleanupChurn(directClient, *resource, expected)
			if created {
				_ = directClient.CoreV1().Namespaces().Delete(context.Background(), ns, metav1.DeleteOptions{})
			}
		}()
		if err := doChurn(ctx, directClient, *resource, ns, *churn, expected); err != nil {
			return nil, fmt.Errorf("churn: %w", err)
		}
	}

	// Poll until both stores agree and the direct one shows every churn write.
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		v, d := snapshot(viaStore), snapshot(directStore)
		diff := compare(v, d)
		if len(diff) == 0 {
			diff = behind(d, expected)
		}
		if len(diff) == 0 {
			return compareResult{Equal: true, ViaCount: len(v), DirectCount: len(d), Churned: *churn, Diff: []diffEntry{}}, nil
		}
		select {
		case <-ctx.Done():
			if len(diff) > maxDiff {
				diff = diff[:maxDiff]
			}
			return compareResult{Equal: false, ViaCount: len(v), DirectCount: len(d), Churned: *churn, Diff: diff}, nil
		case <-tick.C:
		}
	}
}

// startInformer starts a SharedInformer for the resource and waits for its
// initial sync. It stops when ctx ends.
func startInformer(ctx context.Context, client kubernetes.Interface, resource, namespace string) (cache.Store, error) {
	var opts []informers.SharedInformerOption
	if namespace != "" {
		opts = append(opts, informers.WithNamespace(namespace))
	}
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0, opts...)
	var informer cache.SharedIndexInformer
	switch resource {
	case "secrets":
		informer = factory.Core().V1().Secrets().Informer()
	case "endpointslices":
		informer = factory.Discovery().V1().EndpointSlices().Informer()
	}
	factory.StartWithContext(ctx)
	if !cache.WaitForCacheSync(ctx.Done(), informer.HasSynced) {
		return nil, fmt.Errorf("no initial sync of %s before the timeout", resource)
	}
	return informer.GetStore(), nil
}

// snapshot maps namespace/name to resourceVersion and data hash.
func snapshot(store cache.Store) map[string]state {
	out := map[string]state{}
	for _, obj := range store.List() {
		var meta metav1.Object
		var payload any
		switch o := obj.(type) {
		case *corev1.Secret:
			meta = o
			payload = struct {
				Type        corev1.SecretType
				Data        map[string][]byte
				Labels      map[string]string
				Annotations map[string]string
			}{o.Type, o.Data, o.Labels, o.Annotations}
		case *discoveryv1.EndpointSlice:
			meta = o
			payload = struct {
				AddressType discoveryv1.AddressType
				Endpoints   []discoveryv1.Endpoint
				Ports       []discoveryv1.EndpointPort
				Labels      map[string]string
				Annotations map[string]string
			}{o.AddressType, o.Endpoints, o.Ports, o.Labels, o.Annotations}
		default:
			continue
		}
		// json.Marshal sorts map keys, so equal content hashes equally
		// whichever wire format (JSON or protobuf) it was decoded from.
		b, _ := json.Marshal(payload)
		sum := sha256.Sum256(b)
		out[meta.GetNamespace()+"/"+meta.GetName()] = state{RV: meta.GetResourceVersion(), Hash: hex.EncodeToString(sum[:8])}
	}
	return out
}

// compare lists the keys on which the two snapshots differ, sorted.
func compare(via, direct map[string]state) []diffEntry {
	var diff []diffEntry
	for k, d := range direct {
		v, ok := via[k]
		switch {
		case !ok:
			diff = append(diff, diffEntry{Key: k, DirectRV: d.RV, Reason: "missing in via"})
		case v.RV != d.RV:
			diff = append(diff, diffEntry{Key: k, ViaRV: v.RV, DirectRV: d.RV, Reason: "resourceVersion differs"})
		case v.Hash != d.Hash:
			diff = append(diff, diffEntry{Key: k, ViaRV: v.RV, DirectRV: d.RV, Reason: "data differs"})
		}
	}
	for k, v := range via {
		if _, ok := direct[k]; !ok {
			diff = append(diff, diffEntry{Key: k, ViaRV: v.RV, Reason: "missing in direct"})
		}
	}
	sort.Slice(diff, func(i, j int) bool { return diff[i].Key < diff[j].Key })
	return diff
}

// behind lists the churned objects whose last write the direct snapshot
// does not show yet (present at that resourceVersion, or absent if deleted).
func behind(direct map[string]state, expected map[string]string) []diffEntry {
	var diff []diffEntry
	for k, rv := range expected {
		if s, ok := direct[k]; s.RV != rv || (rv == "") == ok {
			reason := "direct store still has a deleted churn object"
			if rv != "" {
				reason = "direct store lacks the churn write at rv " + rv
			}
			diff = append(diff, diffEntry{Key: k, DirectRV: s.RV, Reason: reason})
		}
	}
	sort.Slice(diff, func(i, j int) bool { return diff[i].Key < diff[j].Key })
	return diff
}

// churnNamespace returns the namespace to write churn into: the given one
// (created if missing) or a fresh one. created says whether this run made it.
func churnNamespace(ctx context.Context, client kubernetes.Interface, namespace string) (string, bool, error) {
	name := namespace
	if name == "" {
		name = "cpdriver-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
	_, err := client.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{})
	switch {
	case err == nil:
		return name, true, nil
	case apierrors.IsAlreadyExists(err) && namespace != "":
		return name, false, nil
	default:
		return "", false, fmt.Errorf("creating namespace %s: %w", name, err)
	}
}

// doChurn makes n writes in namespace ns. Write i acts on object churn-(i/3):
// i%3 == 0 creates it, 1 updates it, 2 deletes it (even objects) or updates
// it again (odd ones), so the end state mixes updated and deleted objects.
// expected records the resulting state of each object.
func doChurn(ctx context.Context, client kubernetes.Interface, resource, ns string, n int, expected map[string]string) error {
	for i := 0; i < n; i++ {
		if err := churnOne(ctx, client, resource, ns, i, expected); err != nil {
			return fmt.Errorf("write %d on %s/churn-%d: %w", i, ns, i/3, err)
		}
	}
	return nil
}

// cleanupChurn deletes the churned objects that were left in place.
func cleanupChurn(client kubernetes.Interface, resource string, expected map[string]string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for key, rv := range expected {
		if rv == "" {
			continue // deleted by the churn itself
		}
		ns, name, _ := strings.Cut(key, "/")
		switch resource {
		case "secrets":
			_ = client.CoreV1().Secrets(ns).Delete(ctx, name, metav1.DeleteOptions{})
		case "endpointslices":
			_ = client.DiscoveryV1().EndpointSlices(ns).Delete(ctx, name, metav1.DeleteOptions{})
		}
	}
}

// churnSecret creates, updates or deletes one Secret and returns its new
// resourceVersion ("" after a delete).
func churnSecret(ctx context.Context, client kubernetes.Interface, ns, name string, i int, create, del bool) (string, error) {
	secrets := client.CoreV1().Secrets(ns)
	if del {
		return "", secrets.Delete(ctx, name, metav1.DeleteOptions{})
	}
	s := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"app": "cpdriver"}},
		Data:       map[string][]byte{"write": []byte(strconv.Itoa(i))},
	}
	var err error
	if create {
		s, err = secrets.Create(ctx, s, metav1.CreateOptions{})
	} else {
		s, err = secrets.Update(ctx, s, metav1.UpdateOptions{})
	}
	if err != nil {
		return "", err
	}
	return s.ResourceVersion, nil
}

// churnSlice is churnSecret for an EndpointSlice. Its addresses come from
// 192.0.2.0/24 (TEST-NET-1): stored data only, nothing ever connects there.
func churnSlice(ctx context.Context, client kubernetes.Interface, ns, name string, i int, create, del bool) (string, error) {
	slices := client.DiscoveryV1().EndpointSlices(ns)
	if del {
		return "", slices.Delete(ctx, name, metav1.DeleteOptions{})
	}
	es := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{
			discoveryv1.LabelServiceName: "cpdriver",
			discoveryv1.LabelManagedBy:   "cpdriver",
		}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints: []discoveryv1.Endpoint{{
			Addresses:  []string{fmt.Sprintf("192.0.2.%d", 1+i%250)},
			Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(i%2 == 0)},
		}},
		Ports: []discoveryv1.EndpointPort{{
			Name:     ptr.To("http"),
			Port:     ptr.To(int32(8000 + i%1000)),
			Protocol: ptr.To(corev1.ProtocolTCP),
		}},
	}
	var err error
	if create {
		es, err = slices.Create(ctx, es, metav1.CreateOptions{})
	} else {
		es, err = slices.Update(ctx, es, metav1.UpdateOptions{})
	}
	if err != nil {
		return "", err
	}
	return es.ResourceVersion, nil
}
